#!/usr/bin/env python3
"""A TCP proxy that delays each direction by a fixed time, and can be partitioned.

Used by tools/bench-regions.sh to put a "distant" global Redis on this machine: every
chunk of bytes read from either side is stamped on arrival and written to the other side
at arrival + DELAY (not after the previous chunk's delay: chunks in flight overlap, as on
a long link), in order, per connection and direction. A round trip through it costs
2 × DELAY plus the proxy's own time.

Control, on a loopback control port (--control-port; one command per line, one reply
line each), or by signals:
  partition [blackhole|reset]   blackhole (default, or SIGUSR1): connections stay open
                                and new ones are accepted, but nothing is forwarded; what
                                arrives is held and delivered after the heal, late, as TCP
                                would deliver it once the path is back. reset (SIGUSR2
                                does this): every connection is closed at once (both ends),
                                and new ones are closed as soon as they are accepted.
  heal                          (SIGHUP) forwarding resumes.
  delay MS                      sets the delay for chunks arriving from now on.
  stats [reset]                 one JSON line: state, delay, connections, chunks, bytes,
                                max_lag_ms (the latest a chunk was written past its due
                                time), timed_chunks, late_1ms / _5ms / _20ms (chunks
                                written more than 1 / 5 / 20 ms past it); chunks held by a
                                partition left out. reset: zeroes the lag figures after.
Each change of state is logged on stderr with the wall clock (seconds since the epoch).

Usage: delay-proxy.py --listen PORT --upstream HOST:PORT [--delay-ms 40]
                      [--control-port PORT] [--host 127.0.0.1]
It prints "ready" on stdout once both ports listen. Stdlib only (Python 3.8+).
"""

import argparse
import asyncio
import json
import signal
import socket
import struct
import sys
import time

CHUNK = 65536


class Proxy:
    def __init__(self, upstream_host, upstream_port, delay_s):
        self.upstream = (upstream_host, upstream_port)
        self.delay = delay_s
        self.state = "open"  # open | blackhole | reset
        self.healed = asyncio.Event()
        self.healed.set()
        self.conns = set()  # (client_writer, upstream_writer or None)
        self.accepted = 0
        self.refused = 0
        self.chunks = {"up": 0, "down": 0}
        self.bytes = {"up": 0, "down": 0}
        self.max_lag = 0.0  # worst lateness of a write past its due time, seconds
        self.cuts = 0  # partitions so far (a chunk held by one is late on purpose)
        # Chunks written on time or late (past their due time by more than 1, 5, 20 ms),
        # those held by a partition left out; "stats reset" zeroes these.
        self.timed = 0
        self.late = {1: 0, 5: 0, 20: 0}

    def log(self, what):
        print(f"{time.time():.3f} delay-proxy: {what}", file=sys.stderr, flush=True)

    def set_state(self, state):
        if state == self.state:
            return
        self.state = state
        if state != "open":
            self.cuts += 1
        if state == "open":
            self.healed.set()
        else:
            self.healed.clear()
        if state == "reset":
            for client, upstream in list(self.conns):
                for w in (client, upstream):
                    if w is not None:
                        abort(w)
            self.conns.clear()
        self.log(f"{state} (delay {self.delay * 1000:.1f} ms)")

    async def pump(self, reader, writer, direction):
        """Reads chunks, stamps them; a second task writes each one when due."""
        queue = asyncio.Queue()
        loop = asyncio.get_running_loop()

        async def forward():
            while True:
                due, cuts, data = await queue.get()
                if data is None:
                    break
                wait = due - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                if self.healed.is_set() and cuts == self.cuts:
                    lag = loop.time() - due
                    self.max_lag = max(self.max_lag, lag)
                    self.timed += 1
                    for ms in self.late:
                        if lag * 1000 > ms:
                            self.late[ms] += 1
                else:
                    await self.healed.wait()
                if writer.transport.is_closing():
                    break
                writer.write(data)
                self.chunks[direction] += 1
                self.bytes[direction] += len(data)
                await writer.drain()
            if not writer.transport.is_closing() and writer.can_write_eof():
                writer.write_eof()

        sender = asyncio.ensure_future(forward())
        try:
            while True:
                data = await reader.read(CHUNK)
                # (-1: arrived during a partition, so late on purpose.)
                cuts = self.cuts if self.state == "open" else -1
                queue.put_nowait((loop.time() + self.delay, cuts, data if data else None))
                if not data:
                    break
            await sender
        except (ConnectionError, OSError):
            pass
        finally:
            sender.cancel()

    async def handle(self, client_reader, client_writer):
        if self.state == "reset":
            self.refused += 1
            abort(client_writer)
            return
        self.accepted += 1
        nodelay(client_writer)
        # A blackhole holds the connection open without reaching upstream until the heal.
        await self.healed.wait()
        if client_writer.transport.is_closing():
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError as e:
            self.log(f"upstream connect failed: {e}")
            abort(client_writer)
            return
        nodelay(up_writer)
        entry = (client_writer, up_writer)
        self.conns.add(entry)
        try:
            await asyncio.gather(
                self.pump(client_reader, up_writer, "up"),
                self.pump(up_reader, client_writer, "down"),
            )
        finally:
            self.conns.discard(entry)
            for w in (client_writer, up_writer):
                w.close()

    def stats(self):
        return {
            "state": self.state,
            "delay_ms": self.delay * 1000,
            "connections": len(self.conns),
            "accepted": self.accepted,
            "refused": self.refused,
            "chunks_up": self.chunks["up"],
            "chunks_down": self.chunks["down"],
            "bytes_up": self.bytes["up"],
            "bytes_down": self.bytes["down"],
            "max_lag_ms": round(self.max_lag * 1000, 3),
            "timed_chunks": self.timed,
            "late_1ms": self.late[1],
            "late_5ms": self.late[5],
            "late_20ms": self.late[20],
        }

    def command(self, line):
        words = line.split()
        if not words:
            return "error: empty command"
        cmd, args = words[0].lower(), words[1:]
        if cmd == "partition":
            mode = args[0] if args else "blackhole"
            if mode not in ("blackhole", "reset"):
                return "error: partition blackhole|reset"
            self.set_state(mode)
            return "ok " + mode
        if cmd == "heal":
            self.set_state("open")
            return "ok open"
        if cmd == "delay" and len(args) == 1:
            try:
                ms = float(args[0])
            except ValueError:
                return "error: delay MS"
            if ms < 0:
                return "error: delay MS"
            self.delay = ms / 1000
            self.log(f"delay {ms:.1f} ms")
            return f"ok delay {ms:g}"
        if cmd == "stats":
            out = json.dumps(self.stats(), separators=(",", ":"))
            if args == ["reset"]:
                self.max_lag, self.timed, self.late = 0.0, 0, {1: 0, 5: 0, 20: 0}
            return out
        return "error: unknown command (partition [blackhole|reset], heal, delay MS, stats)"

    async def control(self, reader, writer):
        try:
            while True:
                line = await reader.readline()
                if not line:
                    break
                writer.write((self.command(line.decode(errors="replace")) + "\n").encode())
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()


def nodelay(writer):
    sock = writer.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass


def abort(writer):
    # A reset, not an orderly close: the peer sees the connection fail.
    transport = writer.transport
    sock = writer.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    transport.abort()


async def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on")
    ap.add_argument("--listen", type=int, required=True, help="port to listen on")
    ap.add_argument("--upstream", required=True, help="HOST:PORT to forward to")
    ap.add_argument("--delay-ms", type=float, default=40.0, help="delay each way (40)")
    ap.add_argument("--control-port", type=int, help="loopback port for commands")
    a = ap.parse_args()
    host, _, port = a.upstream.rpartition(":")
    if a.delay_ms < 0:
        ap.error("--delay-ms must be >= 0")
    proxy = Proxy(host or "127.0.0.1", int(port), a.delay_ms / 1000)
    server = await asyncio.start_server(proxy.handle, a.host, a.listen, reuse_address=True)
    if a.control_port:
        await asyncio.start_server(proxy.control, "127.0.0.1", a.control_port, reuse_address=True)
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGUSR1, proxy.set_state, "blackhole")
    loop.add_signal_handler(signal.SIGUSR2, proxy.set_state, "reset")
    loop.add_signal_handler(signal.SIGHUP, proxy.set_state, "open")
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    # Connections still open at the stop are cancelled: that is no error.
    default_handler = loop.get_exception_handler()

    def quiet(loop, context):
        if isinstance(context.get("exception"), asyncio.CancelledError):
            return
        if default_handler is not None:
            default_handler(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(quiet)
    proxy.log(f"{a.host}:{a.listen} -> {a.upstream}, delay {a.delay_ms:g} ms each way")
    print("ready", flush=True)
    async with server:
        await stop.wait()
    proxy.log("stats " + json.dumps(proxy.stats(), separators=(",", ":")))


if __name__ == "__main__":
    asyncio.run(main())
