"""experiments/bench/common.py: the CPU identity the benchmarks print beside a measured peak."""

import argparse

import pytest

from experiments.bench import common

# Two processors of a cloud VM's /proc/cpuinfo (trimmed): the first block is the one read.
_CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC
flags\t\t: fpu sse2 avx2 fma avx512f avx512bw avx512_bf16 avx512_vnni

processor\t: 1
vendor_id\t: GenuineIntel
cpu family\t: 6
model name\t: other
flags\t\t: amx_tile amx_bf16
"""


def test_parse_cpuinfo_reads_the_first_processor():
  got = common.parse_cpuinfo(_CPUINFO)
  assert got == {"model_name": "AMD EPYC", "vendor": "AuthenticAMD", "family": "25", "model": "17",
                 "peak_flags": ["avx2", "fma", "avx512f", "avx512_bf16"]}
  line = common.describe_cpu(dict(got, cores=2))
  assert line == ("cpu: AMD EPYC (AuthenticAMD family 25 model 17), 2 cores, "
                  "flags avx2 fma avx512f avx512_bf16")


def test_parse_cpuinfo_without_fields():
  got = common.parse_cpuinfo("\n\nprocessor\t: 0\n")
  assert got == {"model_name": "", "vendor": "", "family": "", "model": "", "peak_flags": []}
  assert common.describe_cpu({}) == "cpu: unknown (no /proc/cpuinfo)"


def test_cpu_identity_on_this_machine():
  got = common.cpu_identity()
  assert got == {} or (got["cores"] >= 1 and set(got) >= {"model_name", "vendor", "family", "peak_flags"})


def test_best_peak_flops_and_sizes():
  peak, n = common.best_peak_flops([64, 96], reps=2)
  assert peak > 0 and n in (64, 96)
  assert common.matmul_sizes("1024,2048") == [1024, 2048]
  for bad in ("", "a,1", "0", "1024,-1"):
    with pytest.raises(argparse.ArgumentTypeError, match="positive matmul sizes"):
      common.matmul_sizes(bad)
  with pytest.raises(ValueError, match="sizes is empty"):
    common.best_peak_flops([], reps=2)


def test_reps_must_be_at_least_one():
  """--reps=0 compiled everything and then failed with `StatisticsError: no median for empty data`;
  every benchmark's --reps / --repeats is now an int >= 1 (argparse type or absl lower bound)."""
  assert common.positive_int("3") == 3
  for bad in ("0", "-2", "1.5", "x"):
    with pytest.raises(argparse.ArgumentTypeError, match="give an int >= 1"):
      common.positive_int(bad)
  with pytest.raises(ValueError, match=r"reps=0 must be >= 1 \(--reps\)"):
    common.median_seconds(lambda: pytest.fail("ran"), (), 0)


def test_report_cpu_prints_the_identity_it_returns(capsys):
  got = common.report_cpu()  # tests run on the CPU backend
  assert got == common.cpu_identity()
  assert capsys.readouterr().out == (common.describe_cpu(got) + "\n" if got else "")
