"""What the long-document job writes and how it is read back: each rank's output files
(``store``), the manifests read as hostile input (``manifest``), the documents a run must
produce (``expected``), one definition of complete (``completeness``), and ``ringctl gather``
(``gather``, ``export``, ``curve``)."""
