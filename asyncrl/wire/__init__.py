"""What crosses a process boundary: the message schemas (protocol, samples, reward protocol,
bounds), their codec, the ZeroMQ sockets and the router every service runs, who may send what
(auth), where torch.distributed listens (binds), and the blocking replay client."""
