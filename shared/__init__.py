"""What the Scorebox services share: contracts, topology, settings base and runtime glue."""
