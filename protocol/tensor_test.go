package protocol

import (
	"testing"

	"github.com/cudaipc/cudaipc/protocol/storev1"
)

func TestValidateTensor(t *testing.T) {
	for _, c := range []struct {
		size uint64
		t    *storev1.TensorDesc
		ok   bool
	}{
		{1, nil, true},
		{24, &storev1.TensorDesc{Dtype: "float32", Shape: []int64{2, 3}}, true},
		{23, &storev1.TensorDesc{Dtype: "float32", Shape: []int64{2, 3}}, false},
		{2, &storev1.TensorDesc{Dtype: "bfloat16"}, true}, // a scalar
		{1, &storev1.TensorDesc{Dtype: "uint8", Shape: []int64{0, 1 << 62}}, true},
		{16, &storev1.TensorDesc{Dtype: "uint8", Shape: []int64{2, 3}, Strides: []int64{10, 2}}, true}, // last element at 14
		{14, &storev1.TensorDesc{Dtype: "uint8", Shape: []int64{2, 3}, Strides: []int64{10, 2}}, false},
		{8, &storev1.TensorDesc{Dtype: "uint8", Shape: []int64{2, 3}, Strides: []int64{1}}, false},
		{8, &storev1.TensorDesc{Dtype: "int4", Shape: []int64{2}}, false},
		{8, &storev1.TensorDesc{Dtype: "uint8", Shape: []int64{-2}}, false},
		{8, &storev1.TensorDesc{Dtype: "uint8", Shape: []int64{2}, Strides: []int64{-1}}, false},
		{1 << 40, &storev1.TensorDesc{Dtype: "complex128", Shape: []int64{1 << 40, 1 << 40}}, false},
		{1 << 40, &storev1.TensorDesc{Dtype: "uint8", Shape: []int64{3, 3}, Strides: []int64{1 << 62, 1 << 62}}, false},
		{64, &storev1.TensorDesc{Dtype: "uint8", Shape: make([]int64, 33)}, false},
	} {
		err := ValidateTensor(c.t, c.size)
		if (err == nil) != c.ok {
			t.Errorf("%v in %d bytes: %v, want ok=%v", c.t, c.size, err, c.ok)
		}
		if err != nil && CodeOf(err) != storev1.Error_INVALID {
			t.Errorf("%v: code %v, want INVALID", c.t, CodeOf(err))
		}
	}
}

// FuzzValidateTensor: descriptors come from other processes; no input may
// panic, and an accepted one never spans more than the object.
func FuzzValidateTensor(f *testing.F) {
	f.Add(uint64(24), "float32", int64(2), int64(3), int64(3), int64(1))
	f.Add(uint64(1<<40), "uint8", int64(1<<40), int64(1<<30), int64(-1), int64(7))
	f.Fuzz(func(t *testing.T, size uint64, dtype string, d0, d1, s0, s1 int64) {
		for _, td := range []*storev1.TensorDesc{
			{Dtype: dtype, Shape: []int64{d0, d1}},
			{Dtype: dtype, Shape: []int64{d0, d1}, Strides: []int64{s0, s1}},
		} {
			if ValidateTensor(td, size) != nil {
				continue
			}
			n, ok := TensorExtent(td)
			if !ok || n < 0 || uint64(n) > size {
				t.Fatalf("accepted %v in %d bytes with extent %d (%v)", td, size, n, ok)
			}
		}
	})
}
