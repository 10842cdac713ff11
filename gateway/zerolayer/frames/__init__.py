"""The frame door (docs/protocol.md): the sans-IO codec (``protocol``), a connection's write buffer
(``framebuf``), the listener and ``Connection`` (``door``), and telling HTTP or TLS from frames on a
connection's first bytes (``wrong_door``)."""
