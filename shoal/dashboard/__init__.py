"""`shoal dashboard`: a local web page that watches a swarm through the DHT, as a client.

history.py keeps what successive views of the swarm tell (events, loss and throughput over time),
server.py polls the DHT and serves the page and its JSON, command.py is the CLI.
"""
