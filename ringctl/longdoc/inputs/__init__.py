"""The documents a job reads: which ones, in what order, with what ids, and their bytes, in
bounded memory and time (``documents``: the listing; ``records``: JSON flavours; ``tables``
and ``table_meta``: Parquet and Arrow; ``inflate``: gzip; ``saved``: ``save_to_disk``
folders). Shared by the long-document and training jobs."""
