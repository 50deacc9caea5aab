package node_test

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/cudaipc/cudaipc/bundle"
	"github.com/cudaipc/cudaipc/client"
)

// What the bundle tests (bundle, GPU, partial reads) share: tensors of
// random bytes, and the check of a bundle's tensors against them.

// tensorsOf makes tensors of specs, each holding its size of random bytes
// drawn from seed.
func tensorsOf(t *testing.T, seed byte, specs ...bundle.Spec) []client.TensorData {
	t.Helper()
	rng := rand.NewChaCha8([32]byte{seed})
	out := make([]client.TensorData, len(specs))
	for i, spec := range specs {
		n, err := bundle.ByteSize(spec.DType, spec.Shape)
		if err != nil {
			t.Fatal(err)
		}
		out[i] = client.TensorData{Spec: spec, Data: make([]byte, n)}
		rng.Read(out[i].Data)
	}
	return out
}

// tensorNames returns the names of tensors, in order.
func tensorNames(tensors []client.TensorData) []string {
	names := make([]string, len(tensors))
	for i, td := range tensors {
		names[i] = td.Name
	}
	return names
}

// checkTensors checks that manifest m names exactly the named tensors of
// want, of their types and shapes, and that data (the object m describes)
// holds their bytes.
func checkTensors(t *testing.T, where string, data []byte, m *bundle.Manifest, want []client.TensorData, names ...string) {
	t.Helper()
	if len(m.Tensors) != len(names) {
		t.Fatalf("%s: manifest of %d tensors, want %v", where, len(m.Tensors), names)
	}
	for _, name := range names {
		i := m.Index(name)
		if i < 0 {
			t.Fatalf("%s: tensor %q missing", where, name)
		}
		tn := m.Tensors[i]
		var td *client.TensorData
		for k := range want {
			if want[k].Name == name {
				td = &want[k]
			}
		}
		if tn.DType != td.DType || fmt.Sprint(tn.Shape) != fmt.Sprint(td.Shape) {
			t.Fatalf("%s: tensor %q is %s %v, want %s %v", where, name, tn.DType, tn.Shape, td.DType, td.Shape)
		}
		if !bytes.Equal(data[tn.Begin:tn.End], td.Data) {
			t.Fatalf("%s: tensor %q: bytes differ", where, name)
		}
	}
}
