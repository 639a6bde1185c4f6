"""Where sample bytes come from. One small interface; local disk for now."""
from raydl.storage.local import LocalStorage

__all__ = ["LocalStorage"]
