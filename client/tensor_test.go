package client_test

import (
	"context"
	"errors"
	"math/rand/v2"
	"reflect"
	"testing"

	"github.com/cudaipc/cudaipc/client"
)

func TestTensorDescriptorTravels(t *testing.T) {
	d := startDaemon(t, socketPath(t))
	w, r := dial(t, d.socket), dial(t, d.socket)
	ctx := context.Background()
	want := &client.TensorDesc{DType: "bfloat16", Shape: []int64{3, 5, 7}, Strides: []int64{40, 8, 1}}
	o, err := w.Create(ctx, "typed", 2*(2*40+4*8+6+1), client.CreateOptions{Tensor: want})
	if err != nil {
		t.Fatal(err)
	}
	for i := range o.Bytes() {
		o.Bytes()[i] = byte(rand.Uint32())
	}
	if err := o.Seal(ctx); err != nil {
		t.Fatal(err)
	}
	l, err := r.Get(ctx, "typed")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Release()
	if got := l.Info().Tensor; !reflect.DeepEqual(got, want) {
		t.Errorf("Get: tensor %+v, want %+v", got, want)
	}
	info, err := r.Stat(ctx, "typed")
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(info.Tensor, want) {
		t.Errorf("Stat: tensor %+v, want %+v", info.Tensor, want)
	}
	list, err := r.List(ctx)
	if err != nil || len(list) != 1 || !reflect.DeepEqual(list[0].Tensor, want) {
		t.Errorf("List: %+v, %v", list, err)
	}
	// Untyped objects have none.
	put(t, w, "plain", 100)
	if info, err := r.Stat(ctx, "plain"); err != nil || info.Tensor != nil {
		t.Errorf("untyped object: tensor %+v, %v", info.Tensor, err)
	}
}

func TestTensorDescriptorRejected(t *testing.T) {
	d := startDaemon(t, socketPath(t))
	c := dial(t, d.socket)
	for _, tc := range []struct {
		size int64
		t    client.TensorDesc
	}{
		{100, client.TensorDesc{DType: "float33", Shape: []int64{1}}},
		{100, client.TensorDesc{DType: "float32", Shape: []int64{26}}},
		{100, client.TensorDesc{DType: "float32", Shape: []int64{5, 5}, Strides: []int64{1}}},
		{100, client.TensorDesc{DType: "float32", Shape: []int64{-1}}},
		{100, client.TensorDesc{DType: "uint8", Shape: []int64{2, 2}, Strides: []int64{100, 1}}},
		{100, client.TensorDesc{DType: "uint8", Shape: []int64{1 << 40, 1 << 40}}},
	} {
		_, err := c.Create(context.Background(), "bad", tc.size, client.CreateOptions{Tensor: &tc.t})
		if !errors.Is(err, client.ErrInvalid) {
			t.Errorf("%+v in %d bytes: %v, want ErrInvalid", tc.t, tc.size, err)
		}
	}
}
