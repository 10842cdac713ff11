"""Connection-level limits of the frame door, in process: receive buffers given back after a
large frame, a daemon-wide bound on frames in transit, per-address limits, and room for new
clients at max_connections."""

from __future__ import annotations

import struct

from tests.support.inproc import connect, make_server, send
from zerolayer.frames import protocol as p
from zerolayer.frames.protocol import FrameType

BIG = 600_000  # a frame payload far beyond read_buffer_bytes


def frames_of(data: bytes) -> list[tuple[int, int, bytes]]:
    dec = p.FrameDecoder("client", 1 << 20)
    dec.feed(bytes(data))
    out = []
    while (frame := dec.next_frame()) is not None:
        ftype, _, stream, payload = frame
        out.append((ftype, stream, bytes(payload)))
    return out


def big_request(stream: int) -> bytes:
    """A valid binary REQUEST whose prompt makes it BIG bytes long."""
    ids = [7] * ((BIG - 32) // 4)
    return p.encode_request(stream, ids, 2)


def test_receive_memory_follows_the_bytes_that_arrived_and_is_given_back() -> None:
    server, _ = make_server(max_frame_bytes=1 << 20)
    conn, transport = connect(server)
    data = big_request(1)
    send(conn, data[:20])  # the header announces BIG bytes: nothing is allocated for them yet
    assert conn.decoder.capacity == server.cfg.read_buffer_bytes and server.rx_excess == 0
    half = len(data) // 2
    send(conn, data[20:half])  # (in get_buffer() pieces, as the loop delivers them)
    assert conn.decoder.capacity >= half and server.rx_excess > 0
    send(conn, data[half:])
    # Processed (the request was refused: too long for this model's context) and given back.
    assert [f[0] for f in frames_of(transport.data)] == [FrameType.ERROR]
    assert conn.decoder.capacity == server.cfg.read_buffer_bytes
    assert server.rx_excess == 0 and conn.rx_excess == 0
    send(conn, p.encode_request(2, [1, 2], 2))  # the connection goes on as before
    assert len(server.path.engine._inbox) == 1


def test_frames_in_transit_are_bounded_daemon_wide() -> None:
    server, _ = make_server(max_frame_bytes=1 << 20, max_pending_frame_bytes=1_500_000)
    a, ta = connect(server)
    b, tb = connect(server)
    header = struct.pack("<IBBHI", 1_000_000, FrameType.REQUEST, 0, 0, 1)
    send(a, header + bytes(400_000))  # still in transit: a's buffer doubles to 512 KiB
    assert not ta.closed and server.rx_excess > 0
    send(b, header + bytes(900_000))  # b's 1 MiB more would pass 1.5 MB: refused, given back
    assert tb.closed
    ((ftype, stream, payload),) = frames_of(tb.data)
    assert (ftype, stream) == (FrameType.ERROR, 0)
    code, retry_ms, message = p.parse_error(memoryview(payload))
    assert code == p.ErrorCode.OVERLOADED and retry_ms == 1000 and "in transit" in message
    assert server.rx_excess == a.rx_excess  # only a's buffer is still counted
    a.connection_lost(None)
    assert server.rx_excess == 0


def test_connections_per_address_are_limited() -> None:
    server, _ = make_server(max_connections_per_ip=2)
    conns = [connect(server, "10.0.0.1") for _ in range(3)]
    assert [t.closed for _, t in conns] == [False, False, True]
    ((ftype, _, payload),) = frames_of(conns[2][1].data)
    assert p.parse_error(memoryview(payload))[0] == p.ErrorCode.OVERLOADED
    other, t_other = connect(server, "10.0.0.2")  # another address is not affected
    assert not t_other.closed
    conns[0][0].connection_lost(None)
    assert not connect(server, "10.0.0.1")[1].closed  # a freed place can be taken again


def test_at_max_connections_the_longest_idle_connection_makes_room() -> None:
    server, _ = make_server(max_connections=2)
    (a, ta), (b, tb) = connect(server), connect(server)
    a.last_activity -= 10  # a has been idle longest
    b.last_activity -= 5
    c, tc = connect(server)
    assert ta.closed and not tb.closed and not tc.closed
    ((ftype, _, payload),) = frames_of(ta.data)
    assert p.parse_error(memoryview(payload))[0] == p.ErrorCode.IDLE_TIMEOUT
    send(b, p.encode_request(1, [1, 2], 50))  # b is busy now, c just arrived: no room
    d, td = connect(server)
    assert td.closed and not tb.closed and not tc.closed
    assert p.parse_error(memoryview(frames_of(td.data)[0][2]))[0] == p.ErrorCode.OVERLOADED
