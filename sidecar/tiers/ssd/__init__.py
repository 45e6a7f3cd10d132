"""The SSD tier: block slots in preallocated files (`store`) and the plan ops
that read and write them (`ops`)."""
