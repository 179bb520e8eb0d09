"""The causal LM of a job: which families run exactly on a ring (``compat``), the config with
its checked overrides (``overrides``), a directory's own code never run (``custom_code``),
the tokenizer (``tokenize``), loading (``load``; a GGUF file through its cached conversion,
``gguf_file``), and every rank agreeing on all of it, probe included (``agreement``). Shared
by the long-document and training jobs."""
