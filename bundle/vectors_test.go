package bundle

import (
	"encoding/hex"
	"errors"
	"flag"
	"math/rand/v2"
	"path/filepath"
	"reflect"
	"testing"

	"github.com/cudaipc/cudaipc/internal/testutil"
)

// The vectors in testdata/manifest and testdata/sources are the manifest
// and sources-table encodings as files, which the Python client's tests
// (python/tests/test_vectors.py) check its own implementation against.
// go test -run 'ManifestVectors|SourcesVectors' -update rewrites them from
// the code. Every invalid case is refused with ErrInvalid here.
var update = flag.Bool("update", false, "rewrite testdata/manifest and testdata/sources from the code")

func unhex(t *testing.T, s string) []byte {
	t.Helper()
	b, err := hex.DecodeString(s)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

type specVector struct {
	Name  string  `json:"name"`
	DType DType   `json:"dtype"`
	Shape []int64 `json:"shape"`
}

type tensorVector struct {
	Name  string  `json:"name"`
	DType DType   `json:"dtype"`
	Shape []int64 `json:"shape"`
	Begin int64   `json:"begin"`
	End   int64   `json:"end"`
}

// layoutVector is a bundle laid out (256-byte alignment) and encoded: the
// tensors in offset order, the object size they need, the header.
type layoutVector struct {
	Name     string            `json:"name"`
	Specs    []specVector      `json:"specs"`
	Metadata map[string]string `json:"metadata"`
	Tensors  []tensorVector    `json:"tensors"`
	Size     int64             `json:"size"`
	Header   string            `json:"header"` // hex
}

// parseVector is a header another writer may produce (spaces, any key
// order) and what it decodes to.
type parseVector struct {
	Name     string            `json:"name"`
	Header   string            `json:"header"` // hex
	Metadata map[string]string `json:"metadata"`
	Tensors  []tensorVector    `json:"tensors"`
}

type badLayoutVector struct {
	Name  string       `json:"name"`
	Specs []specVector `json:"specs"`
	Error string       `json:"error"`
}

type badHeaderVector struct {
	Name   string `json:"name"`
	Header string `json:"header"` // hex
	Error  string `json:"error"`
}

type manifestVectors struct {
	Comment       string            `json:"comment"`
	Layouts       []layoutVector    `json:"layouts"`
	Parse         []parseVector     `json:"parse"`
	InvalidLayout []badLayoutVector `json:"invalid_layouts"`
	InvalidHeader []badHeaderVector `json:"invalid_headers"`
}

func tensorVectors(ts []Tensor) []tensorVector {
	out := make([]tensorVector, len(ts))
	for i, t := range ts {
		out[i] = tensorVector(t)
	}
	return out
}

func specsOf(sv []specVector) []Spec {
	out := make([]Spec, len(sv))
	for i, s := range sv {
		out[i] = Spec(s)
	}
	return out
}

func manifestCases() manifestVectors {
	v := manifestVectors{Comment: "safetensors bundle manifests (docs/protocol.md 6.3), written by bundle/vectors_test.go; " +
		"error \"invalid\": Go bundle.ErrInvalid, Python ValueError"}
	for _, c := range []struct {
		name  string
		specs []specVector
		meta  map[string]string
	}{
		{"one tensor", []specVector{{"w", F32, []int64{3, 5}}}, nil},
		{"a model with metadata", []specVector{
			{"model.embed.weight", BF16, []int64{7, 33}},
			{"model.layers.0.bias", F16, []int64{13}},
			{"scale", F64, []int64{}},
			{"mask", BOOL, []int64{2, 3, 5}},
			{"packed", F4, []int64{10}},
		}, map[string]string{"format": "pt", "zeta": "last", "alpha": "first"}},
		{"empty and zero-sized tensors", []specVector{{"a", U8, []int64{300}}, {"empty", I64, []int64{0, 4}}, {"b", I32, []int64{2}}}, nil},
		{"names to escape", []specVector{
			{"quote\"back\\slash", U16, []int64{4}},
			{"tab\tnewline\n", I8, []int64{1}},
			{"ünïcödé.权重", C64, []int64{2}},
			{"html <b>&amp;</b>", U32, []int64{1}},
			{"ctl \x01\b\f\x7f \u2028\u2029", U64, []int64{1}},
		}, map[string]string{"note": "line\none \"quoted\" <&>"}},
		{"float8 dtypes", []specVector{{"e4m3", F8E4M3, []int64{16}}, {"e5m2", F8E5M2, []int64{9}}, {"e8m0", F8E8M0, []int64{1}}}, map[string]string{}},
	} {
		m, size, err := Layout(specsOf(c.specs), 0, c.meta)
		if err != nil {
			panic(c.name + ": " + err.Error())
		}
		v.Layouts = append(v.Layouts, layoutVector{c.name, c.specs, c.meta, tensorVectors(m.Tensors), size, hex.EncodeToString(m.Marshal())})
	}
	for _, c := range []struct{ name, header string }{
		{"spaces, keys out of order, trailing padding",
			`{ "b": {"shape": [2], "dtype": "F32", "data_offsets": [8, 16]}, "__metadata__": {"k": "v"}, "a": {"data_offsets": [0, 8], "dtype": "I64", "shape": [1]} }    `},
		{"dense, no metadata", `{"x":{"dtype":"U8","shape":[3],"data_offsets":[0,3]},"y":{"dtype":"U8","shape":[1,1],"data_offsets":[3,4]}}`},
		{"empty object", `{}`},
	} {
		m, err := Parse([]byte(c.header))
		if err != nil {
			panic(c.name + ": " + err.Error())
		}
		v.Parse = append(v.Parse, parseVector{c.name, hex.EncodeToString([]byte(c.header)), m.Metadata, tensorVectors(m.Tensors)})
	}
	for _, c := range []badLayoutVector{
		{"unknown dtype", []specVector{{"w", "F128", []int64{2}}}, "invalid"},
		{"repeated name", []specVector{{"w", F32, []int64{2}}, {"w", F32, []int64{2}}}, "invalid"},
		{"name __metadata__", []specVector{{"__metadata__", F32, []int64{2}}}, "invalid"},
		{"negative dimension", []specVector{{"w", F32, []int64{2, -1}}}, "invalid"},
		{"not a whole number of bytes", []specVector{{"w", F4, []int64{3}}}, "invalid"},
	} {
		if _, _, err := Layout(specsOf(c.Specs), 0, nil); !errors.Is(err, ErrInvalid) {
			panic(c.Name + ": laid out")
		}
		v.InvalidLayout = append(v.InvalidLayout, c)
	}
	for _, c := range []struct{ name, header string }{
		{"not an object", `[]`},
		{"truncated", `{"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}`},
		{"data after the object", `{} {}`},
		{"not JSON", `{w}`},
		{"empty", ``},
	} {
		v.InvalidHeader = append(v.InvalidHeader, badHeaderVector{c.name, hex.EncodeToString([]byte(c.header)), "invalid"})
	}
	return v
}

func TestManifestVectors(t *testing.T) {
	var v manifestVectors
	testutil.CheckVectorFile(t, filepath.Join("..", "testdata", "manifest", "vectors.json"), *update, manifestCases(), &v)
	for _, c := range v.Layouts {
		m, size, err := Layout(specsOf(c.Specs), 0, c.Metadata)
		if err != nil {
			t.Fatalf("%s: %v", c.Name, err)
		}
		if got := tensorVectors(m.Tensors); !reflect.DeepEqual(got, c.Tensors) || size != c.Size {
			t.Errorf("%s: laid out %+v (%d bytes), want %+v (%d)", c.Name, got, size, c.Tensors, c.Size)
		}
		if got := hex.EncodeToString(m.Marshal()); got != c.Header {
			t.Errorf("%s: header %s, want %s", c.Name, got, c.Header)
		}
		back, err := Parse(unhex(t, c.Header))
		if err != nil || !reflect.DeepEqual(tensorVectors(back.Tensors), c.Tensors) || len(back.Metadata) != len(c.Metadata) {
			t.Errorf("%s: parsed %+v, %v", c.Name, back, err)
		}
		for k, val := range c.Metadata {
			if back.Metadata[k] != val {
				t.Errorf("%s: metadata %q = %q, want %q", c.Name, k, back.Metadata[k], val)
			}
		}
	}
	for _, c := range v.Parse {
		m, err := Parse(unhex(t, c.Header))
		if err != nil || !reflect.DeepEqual(tensorVectors(m.Tensors), c.Tensors) || !reflect.DeepEqual(m.Metadata, c.Metadata) {
			t.Errorf("%s: parsed %+v, %v", c.Name, m, err)
		}
	}
	for _, c := range v.InvalidLayout {
		if _, _, err := Layout(specsOf(c.Specs), 0, nil); !errors.Is(err, ErrInvalid) {
			t.Errorf("%s: %v, want ErrInvalid", c.Name, err)
		}
	}
	for _, c := range v.InvalidHeader {
		if m, err := Parse(unhex(t, c.Header)); !errors.Is(err, ErrInvalid) {
			t.Errorf("%s: %+v, %v, want ErrInvalid", c.Name, m, err)
		}
	}
}

type tableVector struct {
	Name    string   `json:"name"`
	Regions []string `json:"regions"` // hex, each a region's encoding
	Table   string   `json:"table"`   // hex
}

type startsVector struct {
	Name   string  `json:"name"`
	Sizes  []int64 `json:"sizes"`
	Starts []int64 `json:"starts"`
	Span   int64   `json:"span"`
}

type badSizesVector struct {
	Name  string  `json:"name"`
	Sizes []int64 `json:"sizes"`
	Error string  `json:"error"`
}

type badTableVector struct {
	Name  string `json:"name"`
	Table string `json:"table"` // hex
	Error string `json:"error"`
}

type sourcesVectors struct {
	Comment       string           `json:"comment"`
	Tables        []tableVector    `json:"tables"`
	Starts        []startsVector   `json:"starts"`
	InvalidTables []badTableVector `json:"invalid_tables"`
	InvalidSizes  []badSizesVector `json:"invalid_sizes"`
}

func sourcesCases() sourcesVectors {
	v := sourcesVectors{Comment: "no-copy versions' sources tables and region starts (docs/protocol.md 6.8), written by bundle/vectors_test.go; " +
		"error \"invalid\": Go bundle.ErrInvalid, Python InternalError (tables) or ValueError (sizes)"}
	r := rand.New(rand.NewPCG(36, 6))
	random := func(n int) []byte {
		b := make([]byte, n)
		for i := range b {
			b[i] = byte(r.Uint32())
		}
		return b
	}
	for _, c := range []struct {
		name  string
		sizes []int
	}{
		{"one region", []int{160}},
		{"three regions", []int{160, 1, 300}},
		{"a region of 256 bytes", []int{256, 7}},
	} {
		var regions [][]byte
		var hexes []string
		for _, n := range c.sizes {
			regions = append(regions, random(n))
			hexes = append(hexes, hex.EncodeToString(regions[len(regions)-1]))
		}
		v.Tables = append(v.Tables, tableVector{c.name, hexes, hex.EncodeToString(EncodeSources(regions))})
	}
	for _, c := range []struct {
		name  string
		sizes []int64
	}{
		{"one", []int64{1000}},
		{"aligned ends", []int64{256, 512, 1}},
		{"unaligned ends", []int64{1, 255, 257, 4 << 20}},
	} {
		starts, span, err := SourceStarts(c.sizes)
		if err != nil {
			panic(err)
		}
		v.Starts = append(v.Starts, startsVector{c.name, c.sizes, starts, span})
	}
	good := EncodeSources([][]byte{random(20), random(9)})
	over := append([]byte{0x01, 0x00, 0x01, 0x00}, random(16)...) // says 65537 bytes
	for _, c := range []struct {
		name  string
		table []byte
	}{
		{"empty", nil},
		{"stray bytes at the end", append(append([]byte{}, good...), 1, 0, 0)},
		{"a zero-length entry", append([]byte{0, 0, 0, 0}, good...)},
		{"an entry past the end", good[:len(good)-1]},
		{"an entry over 64 KiB", over},
	} {
		if _, err := DecodeSources(c.table); !errors.Is(err, ErrInvalid) {
			panic(c.name + ": decoded")
		}
		v.InvalidTables = append(v.InvalidTables, badTableVector{c.name, hex.EncodeToString(c.table), "invalid"})
	}
	v.InvalidSizes = []badSizesVector{
		{"a zero size", []int64{256, 0}, "invalid"},
		{"a negative size", []int64{-1}, "invalid"},
	}
	return v
}

func TestSourcesVectors(t *testing.T) {
	var v sourcesVectors
	testutil.CheckVectorFile(t, filepath.Join("..", "testdata", "sources", "vectors.json"), *update, sourcesCases(), &v)
	for _, c := range v.Tables {
		var regions [][]byte
		for _, h := range c.Regions {
			regions = append(regions, unhex(t, h))
		}
		if got := hex.EncodeToString(EncodeSources(regions)); got != c.Table {
			t.Errorf("%s: table %s, want %s", c.Name, got, c.Table)
		}
		back, err := DecodeSources(unhex(t, c.Table))
		if err != nil || !reflect.DeepEqual(back, regions) {
			t.Errorf("%s: decoded %x, %v", c.Name, back, err)
		}
	}
	for _, c := range v.Starts {
		starts, span, err := SourceStarts(c.Sizes)
		if err != nil || !reflect.DeepEqual(starts, c.Starts) || span != c.Span {
			t.Errorf("%s: starts %v span %d (%v), want %v %d", c.Name, starts, span, err, c.Starts, c.Span)
		}
	}
	for _, c := range v.InvalidTables {
		if got, err := DecodeSources(unhex(t, c.Table)); !errors.Is(err, ErrInvalid) {
			t.Errorf("%s: %x, %v, want ErrInvalid", c.Name, got, err)
		}
	}
	for _, c := range v.InvalidSizes {
		if _, _, err := SourceStarts(c.Sizes); !errors.Is(err, ErrInvalid) {
			t.Errorf("%s: %v, want ErrInvalid", c.Name, err)
		}
	}
}
