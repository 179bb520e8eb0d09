"""The causal LM of a job: which families run exactly on a ring (``compat``), the config with
its checked overrides (``overrides``), a directory's own code never run (``custom_code``),
the tokenizer (``tokenize``), and loading (``load``; a GGUF file through its cached conversion,
``gguf_file``). Shared by the long-document and training jobs; every rank agreeing on all of
it, probe included, is ``longdoc/agreement.py``'s, one floor up."""
