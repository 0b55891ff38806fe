"""A cluster in a box for the chaos tests and benches: hosts in network namespaces on a bridge in
198.18.0.0/15, each with its own trainerd-agent; a 3-member etcd cluster; two coordinators over mutual
TLS; and fault verbs (cut a link, drop/delay/stall a host's traffic, kill or freeze what runs).
Needs root and iproute2. See box.py for the entry point, `ClusterBox`."""
