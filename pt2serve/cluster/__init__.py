"""pt2serve replicas on Ray Serve (needs the `ray` extra): a gateway that routes each request to the replica
holding its session or longest prompt prefix, engine replicas that are the server's own app, autoscaling on
queue depth and KV use. build_app (app.py) is the entry point; docs/replicas.md the guide."""
