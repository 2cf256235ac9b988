"""The node's network: framed streams over libp2p, the services every node serves, links, reachability, restarts."""
