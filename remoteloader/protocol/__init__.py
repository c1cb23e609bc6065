"""The wire: schema-checked msgpack headers with raw tensor frames (``wire``), and the
request/reply client every role uses to reach the master (``rpc``). docs/protocol.md is
the prose version; keep the two in step."""
