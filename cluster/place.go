package cluster

import (
	"encoding/binary"
	"hash/fnv"
)

// Placement places the keys of cluster-wide KV block pools on nodes by
// rendezvous (highest random weight) hashing: a key's owner is the node
// whose score for it is highest. Every node computes the same owner from
// the same node list, with nothing recorded per key; a node that joins
// takes only the keys it now wins, and one that leaves gives up only its
// own, to the node that scored next for each (docs/kv.md, "Across the
// cluster").
//
// A key's score on a node mixes the key's words with the node's name's
// hash through SplitMix64's finalizer: keys are engines' content hashes,
// whose bits are uniform already, and a placement of 10⁴ keys on a few
// nodes costs some tens of microseconds.
type Placement struct {
	nodes []string
	seeds []uint64
}

// NewPlacement returns the placement over nodes (names, each once).
func NewPlacement(nodes []string) *Placement {
	p := &Placement{nodes: nodes, seeds: make([]uint64, len(nodes))}
	for i, n := range nodes {
		h := fnv.New64a()
		h.Write([]byte(n))
		p.seeds[i] = h.Sum64()
	}
	return p
}

// Nodes returns the nodes placed on, as given.
func (p *Placement) Nodes() []string { return p.nodes }

// Owner returns the index in Nodes of key's owner; -1 with no nodes.
// Keys of up to 32 bytes are read whole; a longer key's bytes past 32
// are ignored.
func (p *Placement) Owner(key []byte) int {
	var k [32]byte
	copy(k[:], key)
	w := binary.LittleEndian.Uint64(k[0:]) ^ rotl(binary.LittleEndian.Uint64(k[8:]), 17) ^
		rotl(binary.LittleEndian.Uint64(k[16:]), 31) ^ rotl(binary.LittleEndian.Uint64(k[24:]), 47) ^ uint64(len(key))
	best, bestScore := -1, uint64(0)
	for i, s := range p.seeds {
		if sc := mix64(w ^ s); best < 0 || sc > bestScore || sc == bestScore && p.nodes[i] < p.nodes[best] {
			best, bestScore = i, sc
		}
	}
	return best
}

func rotl(x uint64, k uint) uint64 { return x<<k | x>>(64-k) }

// mix64 is SplitMix64's finalizer: a bijection whose every output bit
// depends on every input bit.
func mix64(z uint64) uint64 {
	z = (z ^ z>>30) * 0xbf58476d1ce4e5b9
	z = (z ^ z>>27) * 0x94d049bb133111eb
	return z ^ z>>31
}
