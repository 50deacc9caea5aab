package kv_test

import (
	"errors"
	"math"
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
	one := &kv.Layout{Blocks: 1, Layers: [][]kv.Part{{{Bytes: 1 << 30}}}}
	for _, c := range [][3]int{{1, 1, 1}, {1, 1, math.MaxInt}, {1, 0, math.MaxInt}, {math.MaxInt, 0, 1}, {1 << 11, 0, 1}} {
		if _, err := kv.NewStaging(one, c[0], c[1], c[2]); !errors.Is(err, kv.ErrMismatch) {
			t.Errorf("a staging of %d blocks of layers from %d, %d of them: %v, want ErrMismatch", c[0], c[1], c[2], err)
		}
	}
}

// FuzzStaging lays out a staged read of a decoded description, as a
// source's daemon does for a peer's kvopen: every block lies inside the
// staging, and the pieces of any stretch cover it.
func FuzzStaging(f *testing.F) {
	for _, kind := range []string{"vllm", "vllm-blocks-first", "sglang", "host"} {
		d := testDesc(kind)
		b, _ := d.MarshalBinary()
		f.Add(b, uint16(4), uint16(0), uint16(3), uint32(100), uint32(500))
		f.Add(b, uint16(1), uint16(2), uint16(1), uint32(0), uint32(1))
	}
	f.Fuzz(func(t *testing.T, db []byte, n, first, count uint16, off, size uint32) {
		var d kv.Desc
		if d.UnmarshalBinary(db) != nil || n > 64 {
			return
		}
		st, err := kv.NewStaging(&d.Layout, int(n), int(first), int(count))
		if err != nil {
			if !errors.Is(err, kv.ErrMismatch) {
				t.Fatalf("staging: %v, want ErrMismatch", err)
			}
			return
		}
		for l := int(first); l < int(first)+int(count); l++ {
			lo, ln := st.Layer(l)
			if lo < 0 || lo+ln > st.Size() {
				t.Fatalf("layer %d at [%d, +%d) of a staging of %d", l, lo, ln, st.Size())
			}
			for p := range d.Layers[l] {
				for k := range int(n) {
					if bo, bn := st.Block(l, p, k); bo < lo || bo+bn > lo+ln {
						t.Fatalf("block %d of part %d of layer %d at [%d, +%d), outside its layer [%d, +%d)", k, p, l, bo, bn, lo, ln)
					}
				}
			}
		}
		o := int64(off) % st.Size()
		m := min(int64(size), st.Size()-o)
		at := o
		st.Pieces(o, m, func(p kv.Piece) {
			if bo, _ := st.Block(p.L, p.P, p.K); bo+p.Skip != at || p.Bytes <= 0 {
				t.Fatalf("piece %+v at %d", p, at)
			}
			at += p.Bytes
		})
		if at != o+m {
			t.Fatalf("pieces of [%d, +%d) end at %d", o, m, at)
		}
	})
}
