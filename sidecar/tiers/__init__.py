"""The lower tiers (SSD, remote store), the I/O pools they run on, and the
data plane that runs their ops of each plan."""
