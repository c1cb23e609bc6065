"""A worker as a Ray actor: the same ``Worker``, bound to the node's IP address."""
from __future__ import annotations


class RayWorker:
    def run(self, master_addr: str, buffer_batches: int) -> int:
        """Serve until drained (returns 0) or killed."""
        import ray

        from .server import Worker

        worker = Worker(master_addr, bind_host=ray.util.get_node_ip_address(), buffer_batches=buffer_batches)
        worker.run()
        return 0
