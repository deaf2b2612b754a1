"""Tasks: the JSONL schema (`schema`), answer conventions (`answers`), generators."""
