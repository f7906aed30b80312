"""Where loractl keeps its files, for the CLI and the daemon alike.

Invariant: with ``LORACTL_HOME`` (or ``--home``) set, *every* file of both sides lives under
that one folder; without it, platformdirs' per-user folders are used. Both sides resolve the
socket with the same function, so a CLI finds the daemon it would have started.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path

APP = "loractl"
SOCKET_NAME = "loractld.sock"
# sockaddr_un.sun_path is 108 bytes including the terminating NUL.
MAX_SOCKET_PATH = 107


@dataclass(frozen=True)
class Layout:
    """The folders of one loractl installation."""

    home: Path | None
    data_dir: Path      # the adapter store and the embedded demo assets
    state_dir: Path     # pins, preload list, logs
    runtime_dir: Path   # socket, registry

    @property
    def store_dir(self) -> Path:
        return self.data_dir / "adapters"

    @property
    def tiny_dir(self) -> Path:
        """The tiny random test model (``--model tiny``) and its adapters."""
        return self.data_dir / "tiny"

    @property
    def models_dir(self) -> Path:
        """Models loractl made itself: GGUF files converted to Hugging Face folders."""
        return self.data_dir / "models"

    @property
    def default_socket(self) -> Path:
        return self.runtime_dir / SOCKET_NAME


def layout(home: str | os.PathLike[str] | None = None) -> Layout:
    """The layout for an explicit home, else ``$LORACTL_HOME``, else the user's platform dirs."""
    home = home or os.environ.get("LORACTL_HOME") or None
    if home:
        root = Path(home).expanduser().absolute()
        return Layout(home=root, data_dir=root, state_dir=root / "state", runtime_dir=root)
    import platformdirs  # here: an explicit --socket (a fast `loractl ls`) never needs it

    return Layout(
        home=None,
        data_dir=Path(platformdirs.user_data_dir(APP)),
        state_dir=Path(platformdirs.user_state_dir(APP)),
        runtime_dir=_user_runtime_dir(),
    )


def _user_runtime_dir() -> Path:
    # Without XDG_RUNTIME_DIR (ssh sessions, containers) platformdirs warns and falls back to
    # /tmp/runtime-UID, which is what we want; the warning would only clutter CLI output.
    import platformdirs

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return Path(platformdirs.user_runtime_dir(APP))


def socket_path(explicit: str | os.PathLike[str] | None = None, home: str | None = None) -> Path:
    """The daemon's socket: ``--socket``, else ``$LORACTL_SOCKET``, else the layout's default."""
    chosen = explicit or os.environ.get("LORACTL_SOCKET")
    if chosen:
        return Path(chosen).expanduser().absolute()
    return layout(home).default_socket
