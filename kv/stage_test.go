package kv_test

import (
	"math/rand/v2"
	"testing"

	"github.com/cudaipc/cudaipc/kv"
)

// TestStagingPieces cuts stagings of each layout into random stretches:
// the pieces of each cover it in order, each inside one block, at the
// offsets Block gives.
func TestStagingPieces(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 1))
	for _, kind := range []string{"vllm", "vllm-blocks-first", "sglang", "host"} {
		l, _ := testLayout(kind, 5, 12, 96)
		for _, c := range [][3]int{{1, 0, 5}, {7, 1, 3}, {12, 4, 1}} {
			st, err := kv.NewStaging(&l, c[0], c[1], c[2])
			if err != nil {
				t.Fatal(err)
			}
			if want := int64(c[0] * c[2] * 2 * 96); st.Size() != want {
				t.Fatalf("%s %v: staging of %d bytes, want %d", kind, c, st.Size(), want)
			}
			for range 50 {
				off := r.Int64N(st.Size())
				n := 1 + r.Int64N(st.Size()-off)
				at := off
				st.Pieces(off, n, func(p kv.Piece) {
					boff, bn := st.Block(p.L, p.P, p.K)
					if boff+p.Skip != at || p.Skip+p.Bytes > bn || p.Bytes <= 0 {
						t.Fatalf("%s %v: piece %+v at %d: block at %d of %d bytes", kind, c, p, at, boff, bn)
					}
					at += p.Bytes
				})
				if at != off+n {
					t.Fatalf("%s %v: pieces of [%d, +%d) end at %d", kind, c, off, n, at)
				}
			}
			for ly := c[1]; ly < c[1]+c[2]; ly++ {
				lo, ln := st.Layer(ly)
				if b, _ := st.Block(ly, 0, 0); b != lo || ln != int64(c[0]*2*96) {
					t.Fatalf("%s %v: layer %d at %d of %d bytes, its first block at %d", kind, c, ly, lo, ln, b)
				}
			}
		}
	}
	if _, err := kv.NewStaging(&kv.Layout{Blocks: 1, Layers: [][]kv.Part{{{Bytes: 1}}}}, 1, 1, 1); err == nil {
		t.Error("a staging of layers past the end")
	}
}
