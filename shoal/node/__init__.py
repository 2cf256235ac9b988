"""The daemon: lifecycle, RPC services, stage worker, data driver."""
