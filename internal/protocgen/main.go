// Command protocgen compiles .proto files and writes their Go code as
// `protoc --go_out=. --go_opt=paths=source_relative` would, with nothing
// but Go: github.com/bufbuild/protocompile stands in for protoc and the
// generator of protoc-gen-go (the module's pinned
// google.golang.org/protobuf) writes the code. It is the module tool that
// `go generate ./protocol/...` runs (go.mod: tool).
//
//	go tool protocgen store.proto
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"path/filepath"

	"github.com/bufbuild/protocompile"
	gengo "google.golang.org/protobuf/cmd/protoc-gen-go/internal_gengo"
	"google.golang.org/protobuf/compiler/protogen"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protodesc"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/pluginpb"
)

func main() {
	flag.Usage = func() {
		fmt.Fprintln(os.Stderr, "usage: protocgen file.proto... (run in the files' directory; writes file.pb.go beside each)")
	}
	flag.Parse()
	if flag.NArg() == 0 {
		flag.Usage()
		os.Exit(2)
	}
	if err := run(flag.Args()); err != nil {
		fmt.Fprintln(os.Stderr, "protocgen:", err)
		os.Exit(1)
	}
}

func run(files []string) error {
	c := protocompile.Compiler{
		Resolver:       protocompile.WithStandardImports(&protocompile.SourceResolver{}),
		SourceInfoMode: protocompile.SourceInfoStandard,
	}
	compiled, err := c.Compile(context.Background(), files...)
	if err != nil {
		return err
	}
	// The request protoc would send: every file with its dependencies first.
	req := &pluginpb.CodeGeneratorRequest{
		FileToGenerate: files,
		Parameter:      proto.String("paths=source_relative"),
	}
	seen := map[string]bool{}
	var add func(f protoreflect.FileDescriptor)
	add = func(f protoreflect.FileDescriptor) {
		if seen[f.Path()] {
			return
		}
		seen[f.Path()] = true
		imports := f.Imports()
		for i := 0; i < imports.Len(); i++ {
			add(imports.Get(i).FileDescriptor)
		}
		req.ProtoFile = append(req.ProtoFile, protodesc.ToFileDescriptorProto(f))
	}
	for _, f := range compiled {
		add(f)
	}
	gen, err := protogen.Options{}.New(req)
	if err != nil {
		return err
	}
	for _, f := range gen.Files {
		if f.Generate {
			gengo.GenerateFile(gen, f)
		}
	}
	gen.SupportedFeatures = gengo.SupportedFeatures
	resp := gen.Response()
	if resp.Error != nil {
		return fmt.Errorf("%s", resp.GetError())
	}
	for _, out := range resp.File {
		if err := os.WriteFile(filepath.FromSlash(out.GetName()), []byte(out.GetContent()), 0o644); err != nil {
			return err
		}
	}
	return nil
}
