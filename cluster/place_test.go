package cluster

import (
	"math/rand/v2"
	"slices"
	"testing"
)

func randomKeys(seed uint64, n, size int) [][]byte {
	r := rand.New(rand.NewPCG(seed, seed+1))
	out := make([][]byte, n)
	for i := range out {
		out[i] = make([]byte, size)
		for j := range out[i] {
			out[i][j] = byte(r.Uint32())
		}
	}
	return out
}

func ownerName(p *Placement, key []byte) string { return p.Nodes()[p.Owner(key)] }

// TestPlacementBalancedAndStable: keys spread evenly over the nodes, the
// owner does not depend on the nodes' order, a node that joins takes only
// keys it now owns, and one that leaves gives up only its own.
func TestPlacementBalancedAndStable(t *testing.T) {
	for _, size := range []int{16, 20, 32} {
		keys := randomKeys(uint64(size), 40_000, size)
		nodes := []string{"a", "b", "c", "node-4"}
		p := NewPlacement(nodes)
		count := map[string]int{}
		for _, k := range keys {
			count[ownerName(p, k)]++
		}
		for _, n := range nodes {
			if got, want := count[n], len(keys)/len(nodes); got < want*9/10 || got > want*11/10 {
				t.Errorf("keys of %d bytes: node %s owns %d of %d keys, want about %d", size, n, got, len(keys), want)
			}
		}
		rev := slices.Clone(nodes)
		slices.Reverse(rev)
		pr := NewPlacement(rev)
		joined := NewPlacement(append(slices.Clone(nodes), "e"))
		left := NewPlacement([]string{"a", "c", "node-4"})
		moved := 0
		for _, k := range keys {
			before := ownerName(p, k)
			if got := ownerName(pr, k); got != before {
				t.Fatalf("the owner depends on the nodes' order: %s and %s", before, got)
			}
			if after := ownerName(joined, k); after != before {
				if after != "e" {
					t.Fatalf("e joined and a key moved from %s to %s", before, after)
				}
				moved++
			}
			if after := ownerName(left, k); before != "b" && after != before {
				t.Fatalf("b left and a key of %s moved to %s", before, after)
			}
		}
		if want := len(keys) / 5; moved < want*9/10 || moved > want*11/10 {
			t.Errorf("a fifth node took %d of %d keys, want about %d", moved, len(keys), want)
		}
	}
	if got := NewPlacement(nil).Owner([]byte("0123456789abcdef")); got != -1 {
		t.Fatalf("no nodes: owner %d", got)
	}
}

// TestPlacementVectors pins the placement: every daemon of a cluster,
// whatever its version, must place a key on the same node.
func TestPlacementVectors(t *testing.T) {
	p := NewPlacement([]string{"a", "b", "c"})
	key := func(fill byte, n int) []byte {
		k := make([]byte, n)
		for i := range k {
			k[i] = fill + byte(i)
		}
		return k
	}
	for _, c := range []struct {
		key  []byte
		want string
	}{
		{key(0, 16), "b"},
		{key(1, 32), "c"},
		{key(7, 20), "c"},
		{key(100, 32), "a"},
	} {
		if got := ownerName(p, c.key); got != c.want {
			t.Errorf("key %x: owner %s, want %s", c.key, got, c.want)
		}
	}
}

func BenchmarkPlacement(b *testing.B) {
	keys := randomKeys(1, 10_000, 32)
	p := NewPlacement([]string{"a", "b", "c"})
	for b.Loop() {
		for _, k := range keys {
			p.Owner(k)
		}
	}
}
