"""No download, ever: the Hugging Face hub is switched off before transformers is imported.

Models and tokenizers are read from local paths only (a directory, a GGUF file, the bundled
files): a hub id must fail at once on a compute node rather than hang or fetch. huggingface_hub
reads HF_HUB_OFFLINE when it is imported, so every path that may import transformers calls
`go_offline` first, and the local supervisor's warm-up, which imports it for forked ranks, sets
the same `OFFLINE_ENV` (`Task.start_env`).
"""

from __future__ import annotations

import os

# Also no progress bars (read when huggingface_hub is imported, transformers follows it): a
# rank's log is a file, where "Loading weights" bars were lines of carriage returns.
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}


def go_offline() -> None:
    """Set OFFLINE_ENV in this process's environment (before transformers is imported)."""
    os.environ.update(OFFLINE_ENV)
