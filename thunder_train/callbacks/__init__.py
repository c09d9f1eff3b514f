"""Lightning integration: ``ThunderCallback`` compiles a LightningModule's steps (see docs/callback.md)."""
from .thunder_callback import ThunderCallback

__all__ = ["ThunderCallback"]
