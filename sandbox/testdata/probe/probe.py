"""probe.py: probe.c's protocol in Python, with threads.

python3 probe.py THREADS [ROLE [-T]]: THREADS threads in all (the main one
included), each with a threading.local value and a signal mask of its own;
-T: no established TCP connection (the listening socket stays).
SIGUSR1 changes every piece of state, SIGUSR2 writes a report to
$PROBE_DIR/<pid>.report (default /tmp/probe) by rename, its first line
"token=" with the content of $PROBE_DIR/token. Keys are probe.c's but for
the pipe (a Python probe runs alone).
"""

import ctypes
import os
import signal
import socket
import struct
import sys
import threading

DIR = os.environ.get("PROBE_DIR", "/tmp/probe")
NTHREADS = int(sys.argv[1])
ROLE = sys.argv[2] if len(sys.argv) > 2 else "main"
NO_TCP_CONN = sys.argv[3:] == ["-T"]
MEM_SIZE = 1 << 20
BASE = 1000

libc = ctypes.CDLL(None, use_errno=True)


class Timespec(ctypes.Structure):
    _fields_ = [("sec", ctypes.c_long), ("nsec", ctypes.c_long)]


class Itimerspec(ctypes.Structure):
    _fields_ = [("interval", Timespec), ("value", Timespec)]


state = {"gen": 0, "counter": 0, "sock_gen": -1}
tls = threading.local()
lock = threading.Condition()
request = {"seq": 0, "kind": 0, "done": 0}
slots = {}


def pattern():
    g, c = state["gen"], state["counter"]
    return bytes((i * 31 + g * 7 + c) & 0xFF for i in range(256)) * (MEM_SIZE // 256)


def thread_mask(i, g):
    blocked = {signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM, signal.SIGTERM, signal.SIGRTMIN + i}
    if g > 0:
        blocked.add(signal.SIGRTMIN + 16 + (i + g) % 8)
    signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def thread_main(i):
    seen, g = 0, 0
    thread_mask(i, 0)
    tls.value = 1000 * i
    with lock:
        slots[i] = (threading.get_native_id(), tls.value)
        lock.notify_all()
        while True:
            while request["seq"] == seen:
                lock.wait()
            seen = request["seq"]
            if request["kind"] == 1:
                g += 1
                tls.value = 1000 * i + g
                thread_mask(i, g)
            slots[i] = (threading.get_native_id(), tls.value)
            request["done"] += 1
            lock.notify_all()


def ask_threads(kind):
    with lock:
        request["kind"] = kind
        request["seq"] += 1
        request["done"] = 0
        lock.notify_all()
        while request["done"] < NTHREADS - 1:
            lock.wait()


def on_signal(sig, frame):
    pass


def set_signals(g):
    for s in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM, signal.SIGTERM):
        signal.signal(s, on_signal)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    signal.signal(signal.SIGINT if g else signal.SIGQUIT, on_signal)
    signal.signal(signal.SIGQUIT if g else signal.SIGINT, signal.SIG_IGN)


def set_timers(g):
    signal.setitimer(signal.ITIMER_REAL, BASE * (g + 1), BASE * (g + 1))
    v = BASE * (g + 2)
    spec = Itimerspec(Timespec(v, 0), Timespec(v, 0))
    if libc.timerfd_settime(state["timerfd"], 0, ctypes.byref(spec), None) < 0:
        raise OSError(ctypes.get_errno(), "timerfd_settime")


def set_cwd(g):
    p = f"{DIR}/cwd-{ROLE}-{g}"
    os.makedirs(p, exist_ok=True)
    os.chdir(p)


def ping(cli, srv, msg):
    try:
        for a, b in ((cli, srv), (srv, cli)):
            a.settimeout(5)
            b.settimeout(5)
            a.sendall(msg)
            if b.recv(64) != msg:
                return 0
        return 1
    except OSError:
        return 0


def send_gen():
    msg = b"gen %d" % state["gen"]
    if (NO_TCP_CONN or ping(state["tcp_cli"], state["tcp_srv"], msg)) and ping(state["unix_cli"], state["unix_srv"], msg):
        state["sock_gen"] = state["gen"]


def connect_to(listener, keep):
    try:
        c = socket.socket(listener.family, socket.SOCK_STREAM)
        c.connect(listener.getsockname())
        listener.settimeout(5)
        s, _ = listener.accept()
    except OSError:
        return None if keep else 0
    if keep:
        return c, s
    c.close()
    s.close()
    return 1


def setup():
    os.makedirs(DIR, exist_ok=True)
    state["mem"] = bytearray(pattern())
    f = os.open(f"{DIR}/{ROLE}.dat", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    os.write(f, bytes(ord("A") + i % 26 for i in range(1024)))
    os.lseek(f, 100, os.SEEK_SET)
    state["file"] = f
    t = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    t.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    t.bind(("127.0.0.1", 0))
    t.listen(8)
    path = f"{DIR}/{ROLE}.sock"
    if os.path.exists(path):
        os.unlink(path)
    u = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    u.bind(path)
    u.listen(8)
    state.update(tcp=t, unix=u, unix_path=path)
    if not NO_TCP_CONN:
        state["tcp_cli"], state["tcp_srv"] = connect_to(t, True)
    state["unix_cli"], state["unix_srv"] = connect_to(u, True)
    fd = libc.timerfd_create(1, os.O_CLOEXEC)  # CLOCK_MONOTONIC
    if fd < 0:
        raise OSError(ctypes.get_errno(), "timerfd_create")
    state["timerfd"] = fd
    set_cwd(0)
    os.environ["PROBE_GEN"] = "0"
    set_signals(0)
    set_timers(0)
    send_gen()


def change():
    state["gen"] += 1
    state["counter"] += 1
    g = state["gen"]
    state["mem"][:] = pattern()
    os.write(state["file"], bytes([ord("a") + g]))
    os.lseek(state["file"], 100 * g, os.SEEK_CUR)
    set_cwd(g)
    os.environ["PROBE_GEN"] = str(g)
    set_signals(g)
    set_timers(g)
    send_gen()
    ask_threads(1)


def status_field(path, key):
    try:
        with open(path) as f:
            for line in f:
                k, _, v = line.partition(":")
                if k == key:
                    return v.strip()
    except OSError:
        pass
    return "?"


def djb(data):
    h = 5381
    for b in data:
        h = (h * 33 + b) & 0xFFFFFFFFFFFFFFFF
    return h


def report_lines(token):
    pid, ppid = os.getpid(), os.getppid()
    try:
        with open(f"/proc/{ppid}/comm") as f:
            comm = f.read().strip()
    except OSError:
        comm = "?"
    pgid, sid = os.getpgid(0), os.getsid(0)
    mem = bytes(state["mem"])
    g = state["gen"]
    out = [f"token={token}", f"role={ROLE}", f"pid={pid}", f"ppid={ppid}", f"ppid_comm={comm}",
           f"pgid={pgid}", f"sid={sid}", f"leads_group={int(pgid == pid)}", f"leads_session={int(sid == pid)}",
           f"cwd={os.getcwd()}", f"env_gen={os.environ.get('PROBE_GEN', '')}", f"env_tag={os.environ.get('PROBE_TAG', '')}",
           f"gen={g}", f"counter={state['counter']}", f"mem_ok={int(mem == pattern())}", f"mem_sum={djb(mem[:4096])}",
           f"file_off={os.lseek(state['file'], 0, os.SEEK_CUR)}", f"file_sum={djb(os.pread(state['file'], 4096, 0))}"]
    for k in ("SigIgn", "SigCgt", "SigBlk"):
        out.append(f"{k}={status_field('/proc/thread-self/status', k)}")
    value, interval = signal.getitimer(signal.ITIMER_REAL)
    spec = Itimerspec()
    libc.timerfd_gettime(state["timerfd"], ctypes.byref(spec))
    out += [f"itimer_interval={int(interval)}", f"itimer_value={int(value)}", "alarms=0",
            f"timerfd_interval={spec.interval.sec}", f"timerfd_value={spec.value.sec}"]
    out += [f"tcp_port={state['tcp'].getsockname()[1]}", f"tcp_conn_peer={0 if NO_TCP_CONN else state['tcp_cli'].getpeername()[1]}",
            f"unix_path={state['unix_path']}", f"sock_gen={state['sock_gen']}",
            f"tcp_accepts={connect_to(state['tcp'], False)}", f"unix_accepts={connect_to(state['unix'], False)}",
            f"tcp_conn={-1 if NO_TCP_CONN else ping(state['tcp_cli'], state['tcp_srv'], token.encode())}",
            f"unix_conn={ping(state['unix_cli'], state['unix_srv'], token.encode())}"]
    ask_threads(2)
    out.append(f"threads={NTHREADS}")
    for i in range(1, NTHREADS):
        tid, value = slots[i]
        out += [f"thread{i}_tls={value}", f"thread{i}_sigblk={status_field(f'/proc/self/task/{tid}/status', 'SigBlk')}"]
    out.append(f"thread0_tls={getattr(tls, 'value', 0)}")
    return out


def report():
    try:
        with open(f"{DIR}/token") as f:
            token = f.read().strip()
    except OSError:
        token = ""
    tmp, final = f"{DIR}/.{os.getpid()}.tmp", f"{DIR}/{os.getpid()}.report"
    with open(tmp, "w") as f:
        f.write("\n".join(report_lines(token)) + "\n")
    os.rename(tmp, final)


def main():
    setup()
    for i in range(1, NTHREADS):
        threading.Thread(target=thread_main, args=(i,), daemon=True).start()
    with lock:
        while len(slots) < NTHREADS - 1:
            lock.wait()
    # Signals are read from the wakeup descriptor, which the C handler
    # writes before Python's handler runs: none is lost between a check
    # and the wait.
    r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(w)
    open(f"{DIR}/{ROLE}.ready", "w").close()
    while True:
        try:
            os.set_blocking(r, True)
            sigs = os.read(r, 64)
        except InterruptedError:
            continue
        for s in struct.unpack(f"{len(sigs)}B", sigs):
            if s == signal.SIGUSR1:
                change()
            elif s == signal.SIGUSR2:
                report()


main()
