"""Durable sessions (hierarchy modes): a worker that dies loses no session.

Every committed KV row and index key of a request is in the node's host arena
(``hierarchy.session``); after every step ``journal`` writes the request's manifest — token
ids, sampling parameters and generator state, token-ring snapshots — double-buffered, once the
rows it names are there (``manifest``). A successor process of the same worker id registers a
new generation with the store (``host_link``), adopts what earlier generations left
(``adoption``) and resumes each session without recomputing its prompt (``restore``); the
gateway re-attaches the client's stream through the worker's ``Resume`` RPC.
"""
