"""Small helpers with no raydl dependencies, used on every floor (Arrow columns, process names, the
splitmix64 hash, prefaulted buffers, optional imports, synthetic image folders)."""
