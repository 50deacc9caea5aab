package bundle

import (
	"bytes"
	"errors"
	"fmt"
	"math/rand/v2"
	"reflect"
	"testing"
)

func randomSpecs(r *rand.Rand, n int) []Spec {
	specs := make([]Spec, n)
	for i := range specs {
		d := DTypes[r.IntN(len(DTypes))]
		shape := make([]int64, r.IntN(4))
		for j := range shape {
			shape[j] = int64(1 + r.IntN(9))
		}
		if d.Bits()%8 != 0 {
			// Sub-byte dtypes need a whole number of bytes.
			shape = append(shape, 8)
		}
		specs[i] = Spec{Name: fmt.Sprintf("layers.%d.w\"ü\\%d", i, r.IntN(1000)), DType: d, Shape: shape}
	}
	return specs
}

func TestLayoutMarshalParseEveryDType(t *testing.T) {
	var specs []Spec
	for _, d := range DTypes {
		specs = append(specs, Spec{Name: "t_" + string(d), DType: d, Shape: []int64{3, 8}})
	}
	specs = append(specs, Spec{Name: "scalar", DType: F32}, Spec{Name: "empty", DType: BF16, Shape: []int64{0, 5}})
	m, size, err := Layout(specs, 0, map[string]string{"format": "pt"})
	if err != nil {
		t.Fatal(err)
	}
	if !m.Aligned(Alignment) {
		t.Fatal("layout not aligned")
	}
	h := m.Marshal()
	if len(h)%8 != 0 {
		t.Fatalf("header of %d bytes is not padded to 8", len(h))
	}
	got, err := Parse(h)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(got, m) {
		t.Fatalf("round trip:\n got %+v\nwant %+v", got, m)
	}
	if err := got.Check(size); err != nil {
		t.Fatal(err)
	}
	if err := got.Check(size - 1); !errors.Is(err, ErrInvalid) {
		t.Fatalf("Check(size-1) = %v, want ErrInvalid", err)
	}
	for _, tt := range got.Tensors {
		want, _ := ByteSize(tt.DType, tt.Shape)
		if tt.Size() != want {
			t.Errorf("%s: %d bytes, want %d", tt.Name, tt.Size(), want)
		}
	}
	// F4 x 3 elements is 12 bits: not a whole number of bytes.
	if _, err := ByteSize(F4, []int64{3}); !errors.Is(err, ErrInvalid) {
		t.Fatalf("F4[3]: %v", err)
	}
}

func TestManyTensors(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	specs := randomSpecs(r, 100_000)
	m, size, err := Layout(specs, 0, nil)
	if err != nil {
		t.Fatal(err)
	}
	h := m.Marshal()
	t.Logf("100000 tensors: header %d bytes, data %d bytes", len(h), size)
	got, err := Parse(h)
	if err != nil {
		t.Fatal(err)
	}
	if len(got.Tensors) != 100_000 || !reflect.DeepEqual(got.Tensors, m.Tensors) {
		t.Fatal("100000-tensor manifest does not round-trip")
	}
	c, csize := got.Compact()
	if !c.Dense() || csize > size {
		t.Fatalf("compact: dense %v, %d > %d", c.Dense(), csize, size)
	}
}

func TestParseRejects(t *testing.T) {
	for _, h := range []string{
		``, `[]`, `{"a":{"dtype":"Q8","shape":[1],"data_offsets":[0,1]}}`,
		`{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}}`,
		`{"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}}`,
		`{"a":{"dtype":"F32","shape":[1],"data_offsets":[8,4]}}`,
		`{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[1],"data_offsets":[2,6]}}`,
		`{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":1}}`,
		`{"__metadata__":{"a":1}}`,
		`{} {}`,
	} {
		if _, err := Parse([]byte(h)); !errors.Is(err, ErrInvalid) {
			t.Errorf("Parse(%q) = %v, want ErrInvalid", h, err)
		}
	}
}

func TestHeaderFile(t *testing.T) {
	m, _, _ := Layout([]Spec{{Name: "x", DType: U8, Shape: []int64{5}}}, 0, nil)
	var b bytes.Buffer
	if err := WriteHeader(&b, m.Marshal()); err != nil {
		t.Fatal(err)
	}
	h, start, err := ReadHeader(bytes.NewReader(b.Bytes()))
	if err != nil || start != int64(b.Len()) || !bytes.Equal(h, m.Marshal()) {
		t.Fatalf("ReadHeader: %v %d", err, start)
	}
	if _, _, err := ReadHeader(bytes.NewReader([]byte{1, 2})); !errors.Is(err, ErrInvalid) {
		t.Fatalf("short file: %v", err)
	}
}

// FuzzParse: the daemon parses manifests that clients write, so Parse must
// never panic, and what it accepts must re-encode to an equal manifest.
func FuzzParse(f *testing.F) {
	m, _, _ := Layout(randomSpecs(rand.New(rand.NewPCG(3, 4)), 5), 0, map[string]string{"k": "v"})
	f.Add(m.Marshal())
	f.Add([]byte(`{"a":{"dtype":"F4","shape":[2],"data_offsets":[0,1]}}`))
	f.Add([]byte(`{"__metadata__":{},"b":{"dtype":"BOOL","shape":[],"data_offsets":[0,1]}}   `))
	f.Add([]byte(`{"__metadata__":{"a":"}\"{"},"x":{"dtype":"U8","shape":[3,0],"data_offsets":[0,0]},"y":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}`))
	f.Add([]byte(`{"x":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},"x":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}`))
	f.Fuzz(func(t *testing.T, h []byte) {
		// The compact fast path decodes what it accepts as encoding/json does.
		if fast, ok, ferr := parseCompact(bytes.TrimRight(h, " ")); ok {
			slow, serr := parseJSON(bytes.TrimRight(h, " "))
			if (ferr == nil) != (serr == nil) {
				t.Fatalf("compact: %v, encoding/json: %v", ferr, serr)
			}
			if ferr == nil {
				fast.sort()
				slow.sort()
				if len(fast.Tensors)+len(slow.Tensors) > 0 && !reflect.DeepEqual(fast.Tensors, slow.Tensors) || len(fast.Metadata) != len(slow.Metadata) ||
					(len(fast.Metadata) > 0 && !reflect.DeepEqual(fast.Metadata, slow.Metadata)) {
					t.Fatalf("compact %+v, encoding/json %+v", fast, slow)
				}
			}
		}
		m, err := Parse(h)
		if err != nil {
			if !errors.Is(err, ErrInvalid) {
				t.Fatalf("error does not wrap ErrInvalid: %v", err)
			}
			return
		}
		if err := m.Check(m.DataSize()); err != nil {
			t.Fatal(err)
		}
		again, err := Parse(m.Marshal())
		if err != nil {
			t.Fatalf("re-encoded manifest rejected: %v", err)
		}
		if len(again.Tensors) != len(m.Tensors) {
			t.Fatal("re-encoding changed the tensor count")
		}
	})
}
