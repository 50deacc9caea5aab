package bundle

import (
	"bytes"
	"errors"
	"math/rand/v2"
	"testing"
)

func TestSourcesRoundTrip(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	for range 50 {
		regions := make([][]byte, 1+r.IntN(20))
		for i := range regions {
			regions[i] = make([]byte, 1+r.IntN(300))
			for j := range regions[i] {
				regions[i][j] = byte(r.Uint32())
			}
		}
		got, err := DecodeSources(EncodeSources(regions))
		if err != nil {
			t.Fatal(err)
		}
		if len(got) != len(regions) {
			t.Fatalf("%d regions back, %d sent", len(got), len(regions))
		}
		for i := range got {
			if !bytes.Equal(got[i], regions[i]) {
				t.Fatalf("region %d differs", i)
			}
		}
	}
	for _, bad := range [][]byte{nil, {1, 0, 0}, {0, 0, 0, 0}, {5, 0, 0, 0, 1}, {0, 0, 1, 0, 1}} {
		if _, err := DecodeSources(bad); !errors.Is(err, ErrInvalid) {
			t.Errorf("DecodeSources(%v) = %v, want ErrInvalid", bad, err)
		}
	}
}

// Regions are laid end to end, never adjacent, each start aligned.
func TestSourceStarts(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 4))
	for range 100 {
		sizes := make([]int64, 1+r.IntN(30))
		for i := range sizes {
			sizes[i] = 1 + r.Int64N(1<<22)
		}
		starts, span, err := SourceStarts(sizes)
		if err != nil {
			t.Fatal(err)
		}
		if starts[0] != 0 || span != starts[len(starts)-1]+sizes[len(sizes)-1] {
			t.Fatalf("starts %v span %d", starts, span)
		}
		for i := 1; i < len(starts); i++ {
			if starts[i]%Alignment != 0 || starts[i] <= starts[i-1]+sizes[i-1] {
				t.Fatalf("region %d at %d: region %d ends at %d", i, starts[i], i-1, starts[i-1]+sizes[i-1])
			}
		}
	}
	for _, bad := range [][]int64{{0}, {5, -1}, {1 << 62, 1 << 62}} {
		if _, _, err := SourceStarts(bad); !errors.Is(err, ErrInvalid) {
			t.Errorf("SourceStarts(%v) = %v, want ErrInvalid", bad, err)
		}
	}
}

func FuzzDecodeSources(f *testing.F) {
	f.Add(EncodeSources([][]byte{{1, 2, 3}, {4}}))
	f.Add([]byte{0xff, 0xff, 0xff, 0xff})
	f.Fuzz(func(t *testing.T, b []byte) {
		regions, err := DecodeSources(b)
		if err != nil {
			return
		}
		if !bytes.Equal(EncodeSources(regions), b) {
			t.Fatal("a decoded table does not encode back to its bytes")
		}
	})
}
