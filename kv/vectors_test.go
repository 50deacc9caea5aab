package kv_test

import (
	"bytes"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"flag"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/cudaipc/cudaipc/kv"
	"github.com/cudaipc/cudaipc/protocol"
)

// The vectors in testdata/kvdesc are descriptions with their encodings, and
// descriptions, encodings and texts the decoder refuses with the field it
// names, as a file that the Python client's tests
// (python/tests/test_kv_desc.py) check its own codec against.
// go test ./kv -run TestDescVectors -update rewrites it from the code.
var update = flag.Bool("update", false, "rewrite testdata/kvdesc from the code")

type partJSON struct {
	Region int   `json:"region"`
	Base   int64 `json:"base"`
	Stride int64 `json:"stride"`
	Bytes  int64 `json:"bytes"`
}

type regionJSON struct {
	Device string `json:"device"`
	Size   int64  `json:"size"`
}

// descJSON is a description as the vectors write it: the id in hex.
type descJSON struct {
	Name    string       `json:"name"`
	ID      string       `json:"id"`
	Node    string       `json:"node"`
	Regions []regionJSON `json:"regions"`
	Blocks  int          `json:"blocks"`
	Layers  [][]partJSON `json:"layers"`
}

func toJSON(d *kv.Desc) descJSON {
	j := descJSON{Name: d.Name, ID: hex.EncodeToString(d.ID[:]), Node: d.Node, Blocks: d.Blocks,
		Regions: make([]regionJSON, len(d.Regions)), Layers: make([][]partJSON, len(d.Layers))}
	for i, r := range d.Regions {
		j.Regions[i] = regionJSON{r.Device, r.Size}
	}
	for l, layer := range d.Layers {
		j.Layers[l] = make([]partJSON, len(layer))
		for p, x := range layer {
			j.Layers[l][p] = partJSON{x.Region, x.Base, x.Stride, x.Bytes}
		}
	}
	return j
}

func fromJSON(t *testing.T, j descJSON) kv.Desc {
	t.Helper()
	d := kv.Desc{Name: j.Name, Node: j.Node, Layout: kv.Layout{Blocks: j.Blocks}}
	id, err := hex.DecodeString(j.ID)
	if err != nil || len(id) != 16 {
		t.Fatalf("vector id %q", j.ID)
	}
	copy(d.ID[:], id)
	for _, r := range j.Regions {
		d.Regions = append(d.Regions, kv.Region{Device: r.Device, Size: r.Size})
	}
	for _, layer := range j.Layers {
		var ps []kv.Part
		for _, p := range layer {
			ps = append(ps, kv.Part{Region: p.Region, Base: p.Base, Stride: p.Stride, Bytes: p.Bytes})
		}
		d.Layers = append(d.Layers, ps)
	}
	return d
}

type validVector struct {
	Name   string   `json:"name"`
	Desc   descJSON `json:"desc"`
	Binary string   `json:"binary"`
	Text   string   `json:"text"`
}

// invalidVector is a refused description (Desc), encoding (Binary) or text
// (Text): Field is the DescError's field, Reason Go's message (for people;
// the Python client words its own).
type invalidVector struct {
	Name   string    `json:"name"`
	Desc   *descJSON `json:"desc,omitempty"`
	Binary string    `json:"binary,omitempty"`
	Text   *string   `json:"text,omitempty"`
	Field  string    `json:"field"`
	Reason string    `json:"reason"`
}

type descVectors struct {
	Valid   []validVector   `json:"valid"`
	Invalid []invalidVector `json:"invalid"`
}

// descCases builds the vectors from the code.
func descCases(t *testing.T) descVectors {
	var v descVectors
	valid := map[string]kv.Desc{}
	for _, kind := range []string{"vllm", "vllm-blocks-first", "sglang", "host"} {
		valid[kind] = testDesc(kind)
	}
	one := testDesc("host")
	one.Name, one.Node, one.Blocks = "0:kv/é-ünïcode space", "", 1
	one.Layers[0][0].Stride = protocol.MaxObjectSize // one block: its stride reaches nothing
	valid["unicode name, no node, one block"] = one
	gpu := testDesc("sglang")
	for i := range gpu.Regions {
		gpu.Regions[i].Device = "GPU-00000000-0000-0000-0000-000000000001"
	}
	gpu.Name = "65534:ns/engine-7/kv"
	valid["GPU regions"] = gpu
	for _, name := range []string{"vllm", "vllm-blocks-first", "sglang", "host", "unicode name, no node, one block", "GPU regions"} {
		d := valid[name]
		b, err := d.MarshalBinary()
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		text, _ := d.MarshalText()
		v.Valid = append(v.Valid, validVector{Name: name, Desc: toJSON(&d), Binary: hex.EncodeToString(b), Text: string(text)})
	}

	bad := func(name string, err error) {
		var de *kv.DescError
		if !errors.As(err, &de) {
			t.Fatalf("%s: %v, want a *kv.DescError", name, err)
		}
		v.Invalid[len(v.Invalid)-1].Name, v.Invalid[len(v.Invalid)-1].Field, v.Invalid[len(v.Invalid)-1].Reason = name, de.Field, de.Error()
	}
	for _, c := range []struct {
		name   string
		change func(d *kv.Desc)
	}{
		{"block past the end", func(d *kv.Desc) { d.Blocks++ }},
		{"base past the end", func(d *kv.Desc) { d.Layers[1][1].Base += 97 }},
		{"stride below bytes", func(d *kv.Desc) { d.Layers[0][0].Stride = 95 }},
		{"zero bytes", func(d *kv.Desc) { d.Layers[0][0].Bytes = 0 }},
		{"negative base", func(d *kv.Desc) { d.Layers[0][1].Base = -1 }},
		{"overflowing stride", func(d *kv.Desc) { d.Layers[0][0].Stride = 1 << 62 }},
		{"stride past any region, one block", func(d *kv.Desc) { d.Blocks, d.Layers[0][0].Stride = 1, protocol.MaxObjectSize+1 }},
		{"overflowing base", func(d *kv.Desc) { d.Layers[0][0].Base = 1<<63 - 1 }},
		{"overflowing bytes", func(d *kv.Desc) { d.Layers[2][1].Bytes, d.Layers[2][1].Stride = 1<<63-1, 1<<63-1 }},
		{"unknown region", func(d *kv.Desc) { d.Layers[2][0].Region = len(d.Regions) }},
		{"negative region", func(d *kv.Desc) { d.Layers[2][0].Region = -1 }},
		{"uneven parts", func(d *kv.Desc) { d.Layers[1] = d.Layers[1][:1] }},
		{"no layers", func(d *kv.Desc) { d.Layers = nil }},
		{"no parts", func(d *kv.Desc) { d.Layers[0] = nil }},
		{"no blocks", func(d *kv.Desc) { d.Blocks = 0 }},
		{"too many blocks", func(d *kv.Desc) { d.Blocks = kv.MaxBlocks + 1 }},
		{"no regions", func(d *kv.Desc) { d.Regions = nil }},
		{"empty region", func(d *kv.Desc) { d.Regions[0].Size = 0 }},
		{"region past the largest object", func(d *kv.Desc) { d.Regions[0].Size = protocol.MaxObjectSize + 1 }},
		{"bad device", func(d *kv.Desc) { d.Regions[0].Device = "gpu0" }},
		{"short UUID", func(d *kv.Desc) { d.Regions[1].Device = "GPU-8b2ee8b5-7a0e-4e6b-9f37-2f3a1c0d4e5" }},
		{"UUID with a space", func(d *kv.Desc) { d.Regions[1].Device = "GPU-8b2ee8b5-7a0e-4e6b-9f37-2f3a1c0d4e 5" }},
		{"empty name", func(d *kv.Desc) { d.Name = "" }},
		{"name with a leading space", func(d *kv.Desc) { d.Name = "1000: ns/kv" }},
		{"name with a trailing space", func(d *kv.Desc) { d.Name = "ns/kv " }},
		{"name with a control character", func(d *kv.Desc) { d.Name = "ns/\tkv" }},
		{"name with a non-canonical uid", func(d *kv.Desc) { d.Name = "01000:ns/kv" }},
		{"name with a uid past 32 bits", func(d *kv.Desc) { d.Name = "4294967296:kv" }},
		{"name too long", func(d *kv.Desc) { d.Name = strings.Repeat("n", protocol.MaxNameLen+1) }},
		{"node too long", func(d *kv.Desc) { d.Node = strings.Repeat("a", 256) }},
		{"control char in node", func(d *kv.Desc) { d.Node = "a\x00b" }},
		{"too many parts", func(d *kv.Desc) {
			for i := range d.Layers {
				for len(d.Layers[i]) <= kv.MaxParts {
					d.Layers[i] = append(d.Layers[i], d.Layers[i][0])
				}
			}
		}},
	} {
		d := testDesc("vllm")
		c.change(&d)
		_, err := d.MarshalBinary()
		j := toJSON(&d)
		v.Invalid = append(v.Invalid, invalidVector{Desc: &j})
		bad(c.name, err)
	}

	good, err := func() ([]byte, error) { d := testDesc("vllm"); return d.MarshalBinary() }()
	if err != nil {
		t.Fatal(err)
	}
	// Offsets in good: the header, name and node, then three regions of 25
	// bytes, then 3 layers of 2 parts of 26 bytes.
	d := testDesc("vllm")
	nameAt := 34
	nodeAt := nameAt + 2 + len(d.Name)
	regionsAt := nodeAt + 2 + len(d.Node)
	partsAt := regionsAt + len(d.Regions)*25
	with := func(f func(b []byte) []byte) []byte { return f(bytes.Clone(good)) }
	put16 := func(b []byte, at, v int) []byte { binary.LittleEndian.PutUint16(b[at:], uint16(v)); return b }
	put32 := func(b []byte, at int, v uint32) []byte { binary.LittleEndian.PutUint32(b[at:], v); return b }
	put64 := func(b []byte, at int, v uint64) []byte { binary.LittleEndian.PutUint64(b[at:], v); return b }
	for _, c := range []struct {
		name string
		b    []byte
	}{
		{"empty", nil},
		{"truncated", good[:len(good)-1]},
		{"trailing bytes", append(bytes.Clone(good), 0)},
		{"bad magic", append([]byte("XKVS"), good[4:]...)},
		{"other version", with(func(b []byte) []byte { return put16(b, 4, 2) })},
		{"too large", make([]byte, protocol.MaxSpaceSize+1)},
		{"header only", good[:34]},
		{"shorter than a header", good[:33]},
		{"zero parts", with(func(b []byte) []byte { return put16(b, 6, 0) })},
		{"too many parts", with(func(b []byte) []byte { return put16(b, 6, kv.MaxParts+1) })},
		{"zero layers", with(func(b []byte) []byte { return put32(b, 8, 0) })},
		{"too many layers", with(func(b []byte) []byte { return put32(b, 8, kv.MaxLayers+1) })},
		{"zero blocks", with(func(b []byte) []byte { return put32(b, 12, 0) })},
		{"too many blocks", with(func(b []byte) []byte { return put32(b, 12, kv.MaxBlocks+1) })},
		{"zero regions", with(func(b []byte) []byte { return put16(b, 32, 0) })},
		{"name past the end", with(func(b []byte) []byte { return put16(b, nameAt, len(b)) })},
		{"node past the end", with(func(b []byte) []byte { return put16(b, nodeAt, 0xffff) })},
		{"name length cut", good[:nameAt+1]},
		{"more layers than sent", with(func(b []byte) []byte { return put32(b, 8, 4) })},
		{"host region with a UUID", with(func(b []byte) []byte { b[regionsAt+1] = 1; return b })},
		{"GPU region without a UUID", with(func(b []byte) []byte { b[regionsAt] = 1; return b })},
		{"unknown region kind", with(func(b []byte) []byte { b[regionsAt] = 2; return b })},
		{"region past the largest object", with(func(b []byte) []byte { return put64(b, regionsAt+17, protocol.MaxObjectSize+1) })},
		{"empty region", with(func(b []byte) []byte { return put64(b, regionsAt+17, 0) })},
		{"base past any region", with(func(b []byte) []byte { return put64(b, partsAt+2, 1<<63) })},
		{"stride past any region", with(func(b []byte) []byte { return put64(b, partsAt+26+10, protocol.MaxObjectSize+1) })},
		{"bytes past any region", with(func(b []byte) []byte { return put64(b, partsAt+18, 1<<64-1) })},
		{"part of an unknown region", with(func(b []byte) []byte { return put16(b, partsAt+26*5, 3) })},
		{"block past the end", with(func(b []byte) []byte { return put32(b, 12, 11) })},
		{"name not UTF-8", with(func(b []byte) []byte { b[nameAt+2] = 0xff; return b })},
		{"name not UTF-8 and a bad region", with(func(b []byte) []byte { b[nameAt+2] = 0xff; b[regionsAt] = 2; return b })},
		{"name a surrogate", with(func(b []byte) []byte { copy(b[nameAt+2+5:], "\xed\xa0\x80"); return b })},
		{"node not UTF-8", with(func(b []byte) []byte { b[nodeAt+2] = 0xc3; return b })},
		{"node with a control character", with(func(b []byte) []byte { b[nodeAt+3] = '\n'; return b })},
		{"empty name", append(append(bytes.Clone(good[:nameAt]), 0, 0), good[nameAt+2+len(d.Name):]...)},
	} {
		var out kv.Desc
		err := out.UnmarshalBinary(c.b)
		v.Invalid = append(v.Invalid, invalidVector{Binary: hex.EncodeToString(c.b)})
		bad(c.name, err)
	}
	text, _ := d.MarshalText()
	for _, c := range []struct{ name, text string }{
		{"text not base64", "not base64!"},
		{"text unpadded", strings.TrimRight(string(text[:len(text)-1]), "=")},
		{"text with data after padding", "QQ==QUFB"},
		{"text of no description", "QUJDREVGR0g="},
		{"empty text", ""},
		{"text too long", strings.Repeat("A", 21852)},
		{"text of a truncated description", string(text[:len(text)-4])},
	} {
		var out kv.Desc
		err := out.UnmarshalText([]byte(c.text))
		s := c.text
		v.Invalid = append(v.Invalid, invalidVector{Text: &s})
		bad(c.name, err)
	}
	return v
}

// TestDescVectors checks testdata/kvdesc/vectors.json against the code: valid
// descriptions encode to their bytes and text and decode back, refused ones
// fail with the field the file names.
func TestDescVectors(t *testing.T) {
	path := filepath.Join("..", "testdata", "kvdesc", "vectors.json")
	b, err := json.MarshalIndent(descCases(t), "", "  ")
	if err != nil {
		t.Fatal(err)
	}
	b = append(b, '\n')
	if *update {
		if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(path, b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	got, err := os.ReadFile(path)
	if err != nil || !bytes.Equal(got, b) {
		t.Fatalf("%s differs from what the code writes (%v); run go test ./kv -run TestDescVectors -update and review the diff", path, err)
	}
	var v descVectors
	if err := json.Unmarshal(got, &v); err != nil {
		t.Fatal(err)
	}
	// The file itself, read back through the codec (not only as the code
	// wrote it).
	for _, c := range v.Valid {
		d := fromJSON(t, c.Desc)
		enc, err := d.MarshalBinary()
		if err != nil || hex.EncodeToString(enc) != c.Binary {
			t.Errorf("%s: encodes to %x (%v), want %s", c.Name, enc, err, c.Binary)
		}
		var dec kv.Desc
		raw, _ := hex.DecodeString(c.Binary)
		if err := dec.UnmarshalBinary(raw); err != nil {
			t.Errorf("%s: %v", c.Name, err)
		} else if j := toJSON(&dec); !jsonEqual(j, c.Desc) {
			t.Errorf("%s: decodes to %+v, want %+v", c.Name, j, c.Desc)
		}
		var fromText kv.Desc
		if err := fromText.UnmarshalText([]byte(c.Text)); err != nil || !jsonEqual(toJSON(&fromText), c.Desc) {
			t.Errorf("%s: text: %v", c.Name, err)
		}
	}
	for _, c := range v.Invalid {
		var err error
		switch {
		case c.Desc != nil:
			d := fromJSON(t, *c.Desc)
			_, err = d.MarshalBinary()
		case c.Text != nil:
			var d kv.Desc
			err = d.UnmarshalText([]byte(*c.Text))
		default:
			raw, herr := hex.DecodeString(c.Binary)
			if herr != nil {
				t.Fatalf("%s: %v", c.Name, herr)
			}
			var d kv.Desc
			err = d.UnmarshalBinary(raw)
		}
		var de *kv.DescError
		if !errors.As(err, &de) || de.Field != c.Field || !errors.Is(err, kv.ErrInvalidDesc) {
			t.Errorf("%s: %v, want a DescError of field %q", c.Name, err, c.Field)
		}
	}
}

func jsonEqual(a, b descJSON) bool {
	x, _ := json.Marshal(a)
	y, _ := json.Marshal(b)
	return bytes.Equal(x, y)
}
