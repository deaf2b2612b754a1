"""Sandboxed command execution for the terminal and code environments (nsjail)."""

from rl.sandbox.sandbox import TASK_MOUNT, ExecResult, Sandbox, SandboxUnavailable

__all__ = ["TASK_MOUNT", "ExecResult", "Sandbox", "SandboxUnavailable"]
