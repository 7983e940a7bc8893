"""steplens analyzer: ingest traces and logs into Parquet tables and answer questions about them."""
