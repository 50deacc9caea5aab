package kv_test

import (
	"bytes"
	"errors"
	"testing"

	"github.com/cudaipc/cudaipc/kv"
	"github.com/cudaipc/cudaipc/protocol"
)

// testDesc returns a valid description of layout kind.
func testDesc(kind string) kv.Desc {
	l, sizes := testLayout(kind, 3, 10, 96)
	d := kv.Desc{Name: "1000:ns/engine-7/kv", ID: [16]byte{1, 2, 3}, Node: "node-a", Layout: l}
	for i, n := range sizes {
		dev := "host"
		if i%2 == 1 {
			dev = "GPU-8b2ee8b5-7a0e-4e6b-9f37-2f3a1c0d4e5f"
		}
		d.Regions = append(d.Regions, kv.Region{Device: dev, Size: n})
	}
	return d
}

// TestDescRoundTrip encodes and decodes each layout, in binary and text.
func TestDescRoundTrip(t *testing.T) {
	for _, kind := range []string{"vllm", "vllm-blocks-first", "sglang", "host"} {
		d := testDesc(kind)
		b, err := d.MarshalBinary()
		if err != nil {
			t.Fatalf("%s: %v", kind, err)
		}
		var got kv.Desc
		if err := got.UnmarshalBinary(b); err != nil {
			t.Fatalf("%s: %v", kind, err)
		}
		b2, _ := got.MarshalBinary()
		if !bytes.Equal(b, b2) || got.Name != d.Name || got.Node != d.Node || got.ID != d.ID || got.Regions[len(d.Regions)-1] != d.Regions[len(d.Regions)-1] {
			t.Errorf("%s: round trip changed the description", kind)
		}
		text, err := d.MarshalText()
		if err != nil {
			t.Fatal(err)
		}
		var fromText kv.Desc
		if err := fromText.UnmarshalText(text); err != nil || fromText.ID != d.ID {
			t.Errorf("%s: text round trip: %v", kind, err)
		}
	}
}

// TestDescRejects checks that invalid descriptions fail with ErrInvalidDesc
// in Validate and in the decoder.
func TestDescRejects(t *testing.T) {
	valid := testDesc("vllm")
	good, err := valid.MarshalBinary()
	if err != nil {
		t.Fatal(err)
	}
	for name, change := range map[string]func(d *kv.Desc){
		"block past the end":   func(d *kv.Desc) { d.Blocks++ },
		"base past the end":    func(d *kv.Desc) { d.Layers[1][1].Base += 97 },
		"stride below bytes":   func(d *kv.Desc) { d.Layers[0][0].Stride = 95 },
		"zero bytes":           func(d *kv.Desc) { d.Layers[0][0].Bytes = 0 },
		"overflowing stride":   func(d *kv.Desc) { d.Layers[0][0].Stride = 1 << 62 },
		"overflowing base":     func(d *kv.Desc) { d.Layers[0][0].Base = 1<<63 - 1 },
		"unknown region":       func(d *kv.Desc) { d.Layers[2][0].Region = len(d.Regions) },
		"negative region":      func(d *kv.Desc) { d.Layers[2][0].Region = -1 },
		"uneven parts":         func(d *kv.Desc) { d.Layers[1] = d.Layers[1][:1] },
		"no layers":            func(d *kv.Desc) { d.Layers = nil },
		"no blocks":            func(d *kv.Desc) { d.Blocks = 0 },
		"no regions":           func(d *kv.Desc) { d.Regions = nil },
		"bad device":           func(d *kv.Desc) { d.Regions[0].Device = "gpu0" },
		"empty name":           func(d *kv.Desc) { d.Name = "" },
		"control char in node": func(d *kv.Desc) { d.Node = "a\x00b" },
		"too many parts": func(d *kv.Desc) {
			for i := range d.Layers {
				for len(d.Layers[i]) <= kv.MaxParts {
					d.Layers[i] = append(d.Layers[i], d.Layers[i][0])
				}
			}
		},
	} {
		d := testDesc("vllm")
		change(&d)
		if _, err := d.MarshalBinary(); !errors.Is(err, kv.ErrInvalidDesc) {
			t.Errorf("%s: MarshalBinary: %v, want ErrInvalidDesc", name, err)
		}
	}
	for name, b := range map[string][]byte{
		"empty":          nil,
		"truncated":      good[:len(good)-1],
		"trailing bytes": append(bytes.Clone(good), 0),
		"bad magic":      append([]byte("XKVS"), good[4:]...),
		"other version":  append(append([]byte("CKVS"), 2, 0), good[6:]...),
		"too large":      make([]byte, protocol.MaxSpaceSize+1),
		"header only":    good[:36],
	} {
		var d kv.Desc
		if err := d.UnmarshalBinary(b); !errors.Is(err, kv.ErrInvalidDesc) {
			t.Errorf("%s: UnmarshalBinary: %v, want ErrInvalidDesc", name, err)
		}
	}
	var d kv.Desc
	if err := d.UnmarshalText([]byte("not base64!")); !errors.Is(err, kv.ErrInvalidDesc) {
		t.Errorf("bad text: %v, want ErrInvalidDesc", err)
	}
}

// FuzzDescBinary decodes arbitrary bytes: a decoded description encodes
// back to the same bytes, and anything else fails with ErrInvalidDesc.
func FuzzDescBinary(f *testing.F) {
	for _, kind := range []string{"vllm", "vllm-blocks-first", "sglang", "host"} {
		d := testDesc(kind)
		b, err := d.MarshalBinary()
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		var d kv.Desc
		if err := d.UnmarshalBinary(b); err != nil {
			if !errors.Is(err, kv.ErrInvalidDesc) {
				t.Fatalf("error %v does not match ErrInvalidDesc", err)
			}
			return
		}
		again, err := d.MarshalBinary()
		if err != nil || !bytes.Equal(again, b) {
			t.Fatalf("decoded description encodes to %d bytes (%v), not the %d decoded", len(again), err, len(b))
		}
	})
}
