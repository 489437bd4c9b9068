"""Start ipykernel the way a sandbox needs it.

Two things differ from ``python -m ipykernel_launcher``, both so that the
whole kernel can be checkpointed by runsc, which cannot save TCP sockets:

* no IOPub pipe: ipykernel binds tcp://127.0.0.1 to carry output of forked
  children; inside a sandbox nothing forks behind the kernel's back;
* no debugpy: the debugger listens on TCP when asked to start.

And two things cut the time of every cell, which under gVisor's ptrace
platform is mostly system calls and thread wake-ups (docs/performance.md):

* a flush of stdout/stderr with nothing to flush returns at once
  (``_skip_empty_flush``); ipykernel does four per cell;
* no 0.5 ms sleep before each execute_reply (``--IPythonKernel._execute_sleep=0``);
* the main thread sends IOPub messages itself when the IOPub thread is idle
  (``_direct_iopub``);
* IPython's history stays in memory (no SQLite writes on every cell).

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


def _skip_empty_flush() -> None:
    """ipykernel flushes stdout and stderr before each execute_reply and again
    before the idle status: four flushes per cell. Each is a round trip to the
    IOPub thread (two events through its ZMQ pipe, then a wait on a
    threading.Event), about 1-3 ms each inside a gVisor sandbox, even when
    the cell printed nothing. A flush is skipped only when it has nothing to
    do: nothing buffered, no flush pending (a write schedules one before it
    returns) and none running on the IOPub thread (which may have taken the
    buffer but not yet queued its message; ``_flush`` is wrapped to say so).
    Then every stream message written earlier is already queued on the IOPub
    thread ahead of whatever the kernel publishes next (the idle status), as
    a full flush would leave it. Anything unexpected (another ipykernel's
    internals) takes the full flush."""
    from ipykernel import iostream

    stream = iostream.OutStream
    full_flush, flush_impl = stream.flush, stream._flush

    def _flush(self):
        self._sandgate_flushing = True
        try:
            flush_impl(self)
        finally:
            self._sandgate_flushing = False

    def flush(self):
        try:
            idle = (self.echo is None and not self._flush_pending
                    and not getattr(self, "_sandgate_flushing", False))
            if idle:
                with self._buffer_lock:
                    buffers = self._buffers.values() if hasattr(self, "_buffers") else [self._buffer]  # 7.x | 6.x
                    idle = all(b.tell() == 0 for b in buffers)
        except AttributeError:
            idle = False
        if not idle:
            full_flush(self)

    stream._flush, stream.flush = _flush, flush


def _direct_iopub() -> None:
    """ipykernel hands every IOPub message from the kernel's main thread to
    its IOPub thread, which sends it: a wake-up through a ZMQ pipe and a GIL
    hand-off while the main thread runs the cell, several ms per message in
    a gVisor sandbox (the busy status reached the agent 10 ms after it was
    made). The main thread now sends itself when the IOPub thread has
    nothing queued and is not running anything: then no message made
    earlier can still be waiting there, so the order on IOPub is the one
    the kernel made them in. A lock keeps the two threads from using the
    socket at once. Other threads (output of the user's threads, forked
    children) keep the queue."""
    import os
    import threading

    from ipykernel import iostream

    pub = iostream.IOPubThread
    handle, really_send, queued_send = pub._handle_event, pub._really_send, pub.send_multipart
    main_thread = threading.main_thread()
    # A child forked while the IOPub thread held the lock would find it held
    # forever (its ``_really_send`` runs inline there): it gets a new one.
    state = {"lock": threading.Lock()}
    os.register_at_fork(after_in_child=lambda: state.update(lock=threading.Lock()))

    def _handle_event(self, msg):
        self._sandgate_running = True
        try:
            handle(self, msg)
        finally:
            self._sandgate_running = False

    def _really_send(self, *args, **kwargs):
        with state["lock"]:
            really_send(self, *args, **kwargs)

    def send_multipart(self, *args, **kwargs):
        if (threading.current_thread() is main_thread and not self._events
                and not getattr(self, "_sandgate_running", False) and self._is_master_process()):
            with state["lock"]:
                really_send(self, *args, **kwargs)
        else:
            queued_send(self, *args, **kwargs)

    pub._handle_event, pub._really_send, pub.send_multipart = _handle_event, _really_send, send_multipart


def main() -> None:
    _die_with_agent()
    _patch()
    try:
        _skip_empty_flush()
    except Exception:  # an ipykernel without these internals keeps its own flush
        pass
    try:
        _direct_iopub()
    except Exception:  # ... and its own IOPub thread
        pass
    # The sleep papers over output that arrives after the reply; clients (and
    # the gateway's own execute) wait for the idle status, which comes after it.
    sys.argv.append("--IPythonKernel._execute_sleep=0")
    # IPython's history in memory: %history, In and _i work for the kernel's
    # life, but no thread writes (and fsyncs) a SQLite file in the workspace
    # on every cell, competing with the cell's own messages for the GIL and
    # the sandbox's CPU. What is lost is history across kernel restarts.
    sys.argv.append("--HistoryManager.hist_file=:memory:")
    from ipykernel.kernelapp import launch_new_instance

    sys.argv[0] = "sandgate-kernel"
    launch_new_instance()


if __name__ == "__main__":
    main()
