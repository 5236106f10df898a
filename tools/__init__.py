"""Developer tools: benchmarks and the quality bar. Not shipped in the runtime packages."""
