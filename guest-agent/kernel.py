"""Start ipykernel the way a sandbox needs it.

Two things differ from ``python -m ipykernel_launcher``, both so that the
whole kernel can be checkpointed by runsc, which cannot save TCP sockets:

* no IOPub pipe: ipykernel binds tcp://127.0.0.1 to carry output of forked
  children; inside a sandbox nothing forks behind the kernel's back;
* no debugpy: the debugger listens on TCP when asked to start.

The transport itself is ipc (unix sockets), chosen by the connection file.
"""

import sys


def _die_with_agent() -> None:
    """Outside a sandbox (tests, a bare host) nothing else would stop a kernel
    whose agent was killed; inside one, the agent's end ends the sandbox."""
    try:
        import ctypes
        import signal

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def _patch() -> None:
    try:
        from ipykernel import iostream

        original = iostream.IOPubThread.__init__

        def init(self, socket, pipe=False, **kw):
            original(self, socket, pipe=False, **kw)

        iostream.IOPubThread.__init__ = init
    except Exception:  # a future ipykernel without the pipe needs no patch
        pass
    try:
        from ipykernel import ipkernel

        ipkernel._is_debugpy_available = False
    except Exception:
        pass


def main() -> None:
    _die_with_agent()
    _patch()
    from ipykernel.kernelapp import launch_new_instance

    sys.argv[0] = "sandgate-kernel"
    launch_new_instance()


if __name__ == "__main__":
    main()
