"""The wire: every message a type (``messages``), one decoder and raw tensor frames
(``wire``), and the request/reply client every role uses to reach the master (``rpc``).
docs/protocol.md's tables are generated from ``messages`` (``docs``)."""
