// Package kv moves blocks of KV cache between the paged KV memory of
// inference engines: an engine registers its KV memory once as a space
// (Register: its regions become registered memory of the daemon, each
// carrying the space's description), hands readers the space's Desc in its
// own metadata, and a reader copies any set of blocks of any range of
// layers into its own space with one ReadBlocks, however many blocks,
// completing layer by layer. A space of another node of a cluster is read
// through the reader's daemon, which writes into the reader's registered
// space (one kv_read request; Plan is the read both daemons run).
//
// A Pool is a cache of KV blocks in the daemon's memory by the engines'
// content hashes: Put stores blocks of a registered space (the daemon
// copies them), Lookup counts the present prefix of a key chain, Get
// copies blocks into a local space layer by layer; each one round trip
// whatever the number of keys. Blocks are immutable once written, and a
// block pinned by a lookup or a get in flight is never evicted. A pool made
// cluster-wide (client.PoolConfig.Cluster) spreads its keys over the live
// nodes of a cluster; the same calls through any node's daemon reach them.
//
// Lifetimes are registered memory's: a space's regions go when its
// engine's connection ends or it closes the space, but a reader mid-read
// holds leases of them, so it never reads freed memory; the source sees a
// read end when its regions' leases do. docs/kv.md has the model, the
// layouts it covers and what is not built yet.
package kv
