// Package seeddata makes reproducible random bytes: processes that share a
// seed make the same bytes, so that one can check every byte another wrote.
// The bytes are ChaCha8 output: random, never runs of zeros, a few GB/s.
// Tests, the demo and the benchmarks all draw their data from here.
package seeddata

import (
	"encoding/binary"
	"hash/fnv"
	"math/rand/v2"
)

// Fill fills b with the stream of seed.
func Fill(b []byte, seed uint64) {
	var key [32]byte
	binary.LittleEndian.PutUint64(key[:], seed)
	binary.LittleEndian.PutUint64(key[8:], seed^0x9e3779b97f4a7c15)
	_, _ = rand.NewChaCha8(key).Read(b)
}

// Bytes returns the first n bytes of the stream of seed.
func Bytes(seed uint64, n int) []byte {
	b := make([]byte, n)
	Fill(b, seed)
	return b
}

// Named derives the seed of one named object from a shared seed, so that
// objects made from one seed differ.
func Named(seed uint64, name string) uint64 {
	h := fnv.New64a()
	var s [8]byte
	binary.LittleEndian.PutUint64(s[:], seed)
	h.Write(s[:])
	h.Write([]byte(name))
	return h.Sum64()
}
