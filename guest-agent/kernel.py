"""Start ipykernel the way a sandbox needs it.

Two things differ from ``python -m ipykernel_launcher``, both so that the
whole kernel can be checkpointed by runsc, which cannot save TCP sockets:

* no IOPub pipe: ipykernel binds tcp://127.0.0.1 to carry output of forked
  children; inside a sandbox nothing forks behind the kernel's back;
* no debugpy: the debugger listens on TCP when asked to start (and it is
  not even imported: ``_lean_imports``, which also leaves out jedi until the
  first completion and IPython's terminal: ~13 MB less to checkpoint and restore).

And two things cut the time of every cell, which under gVisor's ptrace
platform is mostly system calls and thread wake-ups (docs/performance.md):

* a flush of stdout/stderr with nothing to flush returns at once
  (``_skip_empty_flush``); ipykernel does four per cell;
* no 0.5 ms sleep before each execute_reply (``--IPythonKernel._execute_sleep=0``);
* the main thread sends IOPub messages itself when the IOPub thread is idle
  (``_direct_iopub``);
* IPython's history stays in memory (no SQLite writes on every cell).

The transport: shell and IOPub over one unix socketpair with the agent when
the agent hands one over (``kernel_pipe.py``, ``_pipe_app``), and only with
ipykernel 6.17, whose internals are the ones patched; everything else (control,
stdin, heartbeat; shell and IOPub on any other ipykernel) over ipc ZMQ, as
the connection file says.
"""

import os
import sys

try:
    from . import kernel_pipe as KP
except ImportError:  # run as a script
    import kernel_pipe as KP  # type: ignore


def _die_with_agent() -> None:
    """Outside a sandbox (tests, a bare host) nothing else would stop a kernel
    whose agent was killed; inside one, the agent's end ends the sandbox."""
    try:
        import ctypes
        import signal

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass


# Imported by ipykernel's own imports, used by nothing a kernel here does on
# its own: refused while ipykernel loads, importable again afterwards. debugpy
# (and pydevd) come with ipykernel's debugger module, which is off here
# (``_patch``); jedi comes with IPython's completer and is loaded at the first
# completion instead (``_jedi_later``).
REFUSED = ("debugpy", "jedi")


def _lean_imports() -> None:
    """Load ipykernel without the modules in ``REFUSED`` and without
    prompt_toolkit: IPython's package imports its terminal ``embed`` (and the
    terminal shell, prompt_toolkit with it), which a kernel never uses. Those
    three are ~10 MB of the kernel's heap, and a checkpoint ~13 MB smaller
    with the files they map (docs/performance.md). ``IPython.embed`` is the
    real function, imported when first looked up (``_embed_later``). Anything
    that imports these modules later (a cell, a completion) gets them as usual."""
    refused = [m for m in REFUSED if m not in sys.modules]
    for m in refused:
        sys.modules[m] = None  # type: ignore[assignment]  # the import system's "refuse this"
    stub = None if "IPython" in sys.modules else _embed_stub()
    try:
        import ipykernel.debugger  # noqa: F401  (it now says debugpy is unavailable, once and for all)
        import ipykernel.kernelapp  # noqa: F401  (IPython and its completer, which now say jedi is not there)
    except Exception:
        pass
    finally:
        for m in refused:
            if sys.modules.get(m, 0) is None:
                del sys.modules[m]
        if stub is not None:
            if sys.modules.get(stub.__name__) is stub:
                del sys.modules[stub.__name__]
            _embed_later(stub)


def _embed_stub():
    """Stands in for ``IPython.terminal.embed`` while IPython's package loads
    (it does ``from .terminal.embed import embed``); ``_embed_later`` then
    takes its ``embed`` out of the package again."""
    import types

    stub = types.ModuleType("IPython.terminal.embed")

    def embed(*args, **kwargs):  # only until _embed_later: never left bound
        from IPython.terminal.embed import embed as real

        return real(*args, **kwargs)

    stub.embed = embed  # type: ignore[attr-defined]
    sys.modules[stub.__name__] = stub
    return stub


def _embed_later(stub) -> None:
    """``IPython.embed`` as the package's lazy attribute (PEP 562): the real
    function, imported at its first lookup and bound from then on. A wrapper
    left in its place would be one frame too many: ``embed`` takes its
    caller's namespace by frame depth."""
    IPython = sys.modules.get("IPython")
    if IPython is None or IPython.__dict__.get("embed") is not stub.embed:
        return
    del IPython.embed
    previous = IPython.__dict__.get("__getattr__")

    def __getattr__(name):
        if name == "embed":
            from IPython.terminal.embed import embed

            IPython.embed = embed
            return embed
        if previous is not None:
            return previous(name)
        raise AttributeError(f"module 'IPython' has no attribute {name!r}")

    IPython.__getattr__ = __getattr__


def _load_jedi(completer) -> None:
    """What IPython's completer does at its import when jedi is there."""
    import jedi
    import jedi.api.classes  # noqa: F401
    import jedi.api.helpers  # noqa: F401

    jedi.settings.case_insensitive_completion = False
    completer.jedi = jedi
    completer.JEDI_INSTALLED = True


def _jedi_later() -> None:
    """IPython's completer, loaded without jedi (``_lean_imports``), imports
    it at its first completion and completes with it, as it would have.
    Nothing if jedi is not installed (IPython's own completions, as unpatched) or
    was loaded anyway; an IPython without the method wrapped here gets jedi
    imported here and now, as an unpatched kernel has it."""
    import importlib.util

    from IPython.core import completer

    if getattr(completer, "jedi", None) is not None or importlib.util.find_spec("jedi") is None:
        return
    cls = completer.IPCompleter
    jedi_matches = getattr(cls, "_jedi_matches", None)
    if jedi_matches is None:
        _load_jedi(completer)
        return

    def _jedi_matches(self, *args, **kwargs):
        if getattr(completer, "jedi", None) is None:
            try:
                _load_jedi(completer)
            except Exception:  # a broken jedi: IPython's own completions from now on
                self.use_jedi = False
                return []
        return jedi_matches(self, *args, **kwargs)

    # use_jedi's default was read as False (no jedi at import): on, unless configured.
    init = cls.__init__

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if "use_jedi" not in self.config.get(cls.__name__, {}):
            self.use_jedi = True

    cls._jedi_matches = _jedi_matches
    cls.__init__ = __init__


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
    try:  # where ipykernel 7 reads it, at run time (debugpy loaded before the kernel: a .pth file)
        from ipykernel import debugger

        debugger._is_debugpy_available = False
    except Exception:
        pass


def _skip_empty_flush(settle: bool = False) -> None:
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
    import threading

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
            if settle:
                _settle(self)

    def _settle(self):
        # ipykernel's flush returns once the IOPub thread has taken the output;
        # the message itself goes out on the thread's next round. On the
        # agent's pipe, where shell and IOPub share one ordered stream, wait for
        # that round too: the output is then out before whatever the caller
        # sends next (the execute_reply after a cell's last flush).
        pub = self.pub_thread
        if pub is not None and pub.thread is not None and pub.thread.is_alive() \
                and pub.thread.ident != threading.get_ident():
            done = threading.Event()
            pub.schedule(done.set)
            done.wait(self.flush_timeout)

    stream._flush, stream.flush = _flush, flush


def _direct_iopub() -> None:
    """ipykernel hands every IOPub message from the kernel's main thread to
    its IOPub thread, which sends it: a wake-up through a ZMQ pipe and a GIL
    hand-off while the main thread runs the cell, several ms per message in
    a gVisor sandbox (measured there: the busy status reaching the agent 10 ms
    after it was made). So the main thread sends itself when the IOPub thread has
    nothing queued and is not running anything: then no message made
    earlier can still be waiting there, so the order on IOPub is the one
    the kernel made them in. A lock keeps the two threads from using the
    socket at once. Other threads (output of the user's threads, forked
    children) keep the queue. (The IOPub thread itself keeps queueing what it
    sends: a flush it runs takes the output there is when it runs, which may
    be newer than messages queued after the flush was asked for.)"""
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


def _abort_only_what_has_arrived() -> None:
    """After a cell fails (``stop_on_error``), ipykernel 6.17 aborts the execute
    requests already waiting and ends the abort from a timer of
    ``stop_on_error_timeout`` (0 s by default). A timer runs after the ready
    descriptors of the loop's next pass: a request the client sent on seeing
    the failed cell's idle status, if it is in the pipe by then, is aborted
    too ("aborted", no output). Over the pipe that takes only a stall of a
    millisecond or two right after the idle, which a loaded host gives. As later ipykernels
    do, with no timeout the end of the abort is queued at once, behind
    exactly the requests the flush has just taken."""
    import ipykernel
    from ipykernel.kernelbase import Kernel

    if tuple(ipykernel.version_info[:2]) not in PIPE_IPYKERNELS:
        return  # this is 6.17's method; later ones do this themselves
    with_timeout = Kernel._abort_queues

    def _abort_queues(self):
        if self.stop_on_error_timeout:
            return with_timeout(self)
        self._aborting = True
        self.log.info("Aborting queue")
        self.shell_stream.flush()

        async def stop_aborting():
            self.log.info("Finishing abort")
            self._aborting = False

        self.schedule_dispatch(stop_aborting)

    Kernel._abort_queues = _abort_queues


# The ipykernel versions the pipe has been run against (Debian 12's); any other
# stays on ZMQ rather than risk internals that moved.
PIPE_IPYKERNELS = {(6, 17)}


def _cache_getpid() -> None:
    """``os.getpid`` answered from memory. Every call is a system call (~0.04 ms
    under ptrace) and ipykernel and jupyter_client make ~20 per cell (a message
    id, a fork check per send, the IOPub thread's fork check, the compiler's
    temporary directory, each log record). A process's pid changes only across
    a fork: the cache is dropped before every ``os.fork`` and refilled on the
    next call, in parent and child alike, so at-fork handlers registered
    before this one see the right pid too. (A C extension that forks behind
    Python's back without PyOS_AfterFork_Child would see its parent's pid.)"""
    real = os.getpid
    cache = [real()]

    def getpid() -> int:
        pid = cache[0]
        if pid is None:
            pid = cache[0] = real()
        return pid

    getpid.__doc__ = real.__doc__
    # Dropped in the child too: between the before hooks and the fork another
    # thread may run (os.fork takes the import lock) and refill it.
    os.register_at_fork(before=lambda: cache.__setitem__(0, None),
                        after_in_child=lambda: cache.__setitem__(0, None))
    os.getpid = getpid


def _pipe_app(end: "KP.KernelEnd"):
    """An IPKernelApp whose shell and IOPub go over the agent's pipe, or None
    when this ipykernel is not the one this was written against (6.17: a
    ZMQStream shell and an IOPubThread); then the kernel stays on ZMQ.

    Shell: the kernel's ``shell_stream`` becomes a stand-in for a ZMQStream
    (traitlets checks the class) that reads requests from the pipe on the
    kernel's event loop and writes replies to it. IOPub: the IOPub thread's
    PUB socket becomes the pipe, so stdout batching, the direct sends from the
    main thread (``_direct_iopub``) and output of the user's threads work as
    before. The shell ROUTER is still bound (ipykernel's debugger wiring
    expects it) but nothing is sent to it."""
    import ipykernel
    import zmq
    from ipykernel.iostream import IOPubThread
    from ipykernel.kernelapp import IPKernelApp
    from ipykernel import kernelbase
    from ipykernel.kernelbase import Kernel
    from tornado.ioloop import IOLoop
    from zmq.eventloop.zmqstream import ZMQStream

    trait = Kernel.class_traits().get("shell_stream")
    if tuple(ipykernel.version_info[:2]) not in PIPE_IPYKERNELS or getattr(trait, "klass", None) is not ZMQStream:
        return None

    class PipeSocket:
        """IOPub's socket, as the IOPub thread uses it."""

        def __init__(self, context):
            self.context = context  # the IOPub thread makes its inproc event pipe from it

        def send_multipart(self, msg, *args, **kwargs):
            end.send(KP.IOPUB, msg)

        def close(self, linger=None):
            pass

    class PipeStream(ZMQStream):
        """The shell stream. Not a ZMQStream's __init__: there is no socket."""

        def __init__(self, io_loop):
            self.io_loop = io_loop
            self.socket = None
            self.end = end
            self._recv_callback = None
            self._decoder = KP.Decoder()
            self._eof = False
            self._watching = False

        def on_recv(self, callback, copy=True):
            self._recv_callback = callback
            if callback is not None and not self._watching:
                self._watching = True
                self.io_loop.add_handler(end.fileno(), self._readable, IOLoop.READ)

        def _readable(self, fd, events):
            self._read_all()

        def _read_all(self) -> int:
            """Hand every complete request that has arrived to the kernel."""
            n = 0
            while not self._eof:
                data = end.recv_ready()
                if data is None:
                    break
                if not data:  # the agent is gone; the kernel dies with it (PR_SET_PDEATHSIG)
                    self._eof = True
                    self.io_loop.remove_handler(end.fileno())
                    break
                for channel, parts in self._decoder.feed(data):
                    if channel == KP.SHELL and isinstance(parts, list) and self._recv_callback is not None:
                        n += 1
                        self._recv_callback([zmq.Frame(p) for p in parts])
                if len(data) < KP.READ_SIZE:
                    break
            return n

        def flush(self, flag=zmq.POLLIN | zmq.POLLOUT, limit=None):
            # Sends are synchronous; a flush for POLLIN takes what has arrived.
            return self._read_all() if flag & zmq.POLLIN else 0

        def send_multipart(self, msg, flags=0, copy=True, track=False, callback=None, **kwargs):
            end.send(KP.SHELL, msg)

        def send(self, msg, flags=0, copy=True, track=False, callback=None, **kwargs):
            end.send(KP.SHELL, [msg])

        def receiving(self):
            return self._recv_callback is not None

        def sending(self):
            return False

        def closed(self):
            return self._eof

        def close(self, linger=None):
            if self._watching and not self._eof:
                self.io_loop.remove_handler(end.fileno())
            self._eof = True

    async def _flush_control_queue(self):
        # ipykernel 6 wakes the control thread on every shell request to take
        # control messages first (for the debugger, off here) and then does
        # not even wait for it (the future it returns is dropped): two thread
        # hand-offs per cell, 1-2 ms inside a sandbox. Control messages are
        # handled on the control thread as they come, as before.
        return None

    Kernel._flush_control_queue = _flush_control_queue
    # ipykernel installs this for every request it handles; an interrupt that
    # comes in the middle of a send on the pipe then waits for the frame's end.
    kernelbase.default_int_handler = end.deferred_interrupt

    class App(IPKernelApp):
        def init_iopub(self, context):
            self.iopub_socket = PipeSocket(context)
            self.configure_tornado_logger()
            self.iopub_thread = IOPubThread(self.iopub_socket, pipe=False)
            self.iopub_thread.start()
            self.iopub_socket = self.iopub_thread.background_socket

        def init_kernel(self):
            super().init_kernel()
            # The ROUTER stays bound and its stream open, unused: closing it
            # would leave ipykernel's debug DEALER reconnecting to it forever.
            self._zmq_shell_stream = self.kernel.shell_stream
            self._zmq_shell_stream.stop_on_recv()
            self.kernel.shell_stream = PipeStream(self._zmq_shell_stream.io_loop)

        def initialize(self, argv=None):
            super().initialize(argv)
            # traitlets leaves the logger at DEBUG and filters in the handler:
            # ipykernel then makes four log records per cell that are never
            # written (a stack walk and a getpid each).
            self.log.setLevel(self.log_level)

    return App


def main() -> None:
    _die_with_agent()
    end = KP.KernelEnd(int(os.environ.pop(KP.ENV))) if KP.ENV in os.environ else None
    _cache_getpid()
    _lean_imports()
    _patch()
    try:
        _abort_only_what_has_arrived()
    except Exception:  # internals not as in 6.17: its own abort stays
        pass
    try:
        _jedi_later()
    except Exception:  # IPython's completer did not load: no completions to make either way
        pass
    app = None
    if end is not None:
        try:
            app = _pipe_app(end)
        except Exception:
            app = None
    try:
        _skip_empty_flush(settle=app is not None)
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
    sys.argv[0] = "sandgate-kernel"
    if end is not None:
        # The agent waits for this before it sends anything to the shell.
        end.send(KP.HELLO, [b"pipe" if app is not None else b"zmq"])
        if app is None:
            end.close()
    if app is None:
        from ipykernel.kernelapp import IPKernelApp as app
    app.launch_instance()


if __name__ == "__main__":
    main()
