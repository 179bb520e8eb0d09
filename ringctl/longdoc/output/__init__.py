"""What the long-document job writes and how it is read back: every file's name (``names``),
each rank's output files (``store``), run.json and documents.json, written and read as hostile
input (``manifest``), the documents a run must produce (``expected``), one definition of
complete (``completeness``), and ``ringctl gather`` (``gather``, ``export``, ``curve``)."""
