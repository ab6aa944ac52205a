"""Tables and reports written from results."""
