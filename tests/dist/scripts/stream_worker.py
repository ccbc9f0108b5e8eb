"""Rank 1 streams N bytes over TCP to rank 0 (at MASTER_ADDR); rank 0 counts them.
Prints the seconds the transfer took, as measured by the receiver."""
import os
import socket
import sys
import time

n = int(sys.argv[1])
port = int(os.environ["MASTER_PORT"]) + 1
if os.environ["RANK"] == "0":
    srv = socket.create_server(("", port))
    conn, _ = srv.accept()
    got, t0 = 0, None
    while True:
        data = conn.recv(1 << 16)
        if not data:
            break
        if t0 is None:
            t0 = time.monotonic()
        got += len(data)
    print(f"GOT {got} in {time.monotonic() - (t0 or 0):.3f}", flush=True)
else:
    for _ in range(100):  # the server may not listen yet
        try:
            conn = socket.create_connection((os.environ["MASTER_ADDR"], port))
            break
        except ConnectionRefusedError:
            time.sleep(0.05)
    conn.sendall(b"x" * n)
    conn.close()
