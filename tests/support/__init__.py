"""What several test modules share: a real MLflow server, a local Ray cluster, deployment
files, fault hooks and the fault harness, image data, generated blobs."""
