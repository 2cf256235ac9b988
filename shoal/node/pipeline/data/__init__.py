"""The data node's engine: batches, routes, loss, the ledger of every microbatch, audits."""
