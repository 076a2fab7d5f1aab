"""Cluster description helpers: `hexi-cluster detect` (this node's cluster-spec entry) and
`hexi-cluster bench` (measured `links:` between nodes, a torch.distributed job)."""
