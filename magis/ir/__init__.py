"""The graph IR: nodes, graphs, tensor metadata (see :mod:`magis.ir.graph`)."""

from magis.ir.graph import Graph, GraphError, Node, Ref, Role, Signature, TensorMeta, iter_refs, map_refs

__all__ = ["Graph", "GraphError", "Node", "Ref", "Role", "Signature", "TensorMeta", "iter_refs", "map_refs"]
