"""Small building blocks every layer uses and that import nothing of the library but its
errors: events and warnings (`logs`), digests (`hashing`), declared hooks (`hooks`) and the
descriptions ranks compare (`describe`)."""
