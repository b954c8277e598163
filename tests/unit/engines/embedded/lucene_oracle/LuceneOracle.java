// Reference oracle: the real Lucene CJKAnalyzer and BM25 (what OpenSearch's `cjk` analyzer and
// `match` query run), used to check the embedded engine's Python port bit for bit.
//
// Records on stdin and stdout are UTF-8, separated by NUL; fields inside a record by \u0001.
//   tables   -> StandardTokenizerImpl's JFlex DFA tables as "name=v,v,v" lines
//   analyze  -> per input text, its tokens
//   bm25     -> first record: doc count N; then N doc texts; then queries. Per query, the hits
//               as "docIndex:floatBitsHex" in Lucene's rank order (score desc, doc id asc).
import java.io.ByteArrayOutputStream;
import java.io.InputStream;
import java.io.PrintStream;
import java.lang.reflect.Field;
import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.List;
import org.apache.lucene.analysis.Analyzer;
import org.apache.lucene.analysis.TokenStream;
import org.apache.lucene.analysis.cjk.CJKAnalyzer;
import org.apache.lucene.analysis.standard.StandardTokenizer;
import org.apache.lucene.analysis.tokenattributes.CharTermAttribute;
import org.apache.lucene.document.Document;
import org.apache.lucene.document.Field.Store;
import org.apache.lucene.document.TextField;
import org.apache.lucene.index.DirectoryReader;
import org.apache.lucene.index.IndexWriter;
import org.apache.lucene.index.IndexWriterConfig;
import org.apache.lucene.search.IndexSearcher;
import org.apache.lucene.search.Query;
import org.apache.lucene.search.ScoreDoc;
import org.apache.lucene.store.ByteBuffersDirectory;
import org.apache.lucene.util.QueryBuilder;

public class LuceneOracle {
  public static void main(String[] args) throws Exception {
    PrintStream out = new PrintStream(System.out, false, StandardCharsets.UTF_8);
    switch (args[0]) {
      case "tables" -> tables(out);
      case "analyze" -> analyze(readRecords(System.in), out);
      case "bm25" -> bm25(readRecords(System.in), out);
      default -> throw new IllegalArgumentException(args[0]);
    }
    out.flush();
  }

  static List<String> readRecords(InputStream in) throws Exception {
    String all = new String(in.readAllBytes(), StandardCharsets.UTF_8);
    List<String> records = new ArrayList<>();
    if (all.isEmpty()) return records;
    for (String r : all.split("\u0000", -1)) records.add(r);
    return records;
  }

  static void tables(PrintStream out) throws Exception {
    Class<?> impl = Class.forName("org.apache.lucene.analysis.standard.StandardTokenizerImpl");
    for (String name :
        new String[] {
          "ZZ_CMAP_TOP", "ZZ_CMAP_BLOCKS", "ZZ_ACTION", "ZZ_ROWMAP", "ZZ_TRANS", "ZZ_ATTRIBUTE"
        }) {
      Field f = impl.getDeclaredField(name);
      f.setAccessible(true);
      int[] values = (int[]) f.get(null);
      StringBuilder sb = new StringBuilder(name).append('=');
      for (int i = 0; i < values.length; i++) {
        if (i > 0) sb.append(',');
        sb.append(values[i]);
      }
      out.println(sb);
    }
  }

  static List<String> tokens(Analyzer analyzer, String text) throws Exception {
    List<String> result = new ArrayList<>();
    try (TokenStream ts = analyzer.tokenStream("f", text)) {
      CharTermAttribute term = ts.addAttribute(CharTermAttribute.class);
      ts.reset();
      while (ts.incrementToken()) result.add(term.toString());
      ts.end();
    }
    return result;
  }

  static void analyze(List<String> texts, PrintStream out) throws Exception {
    Analyzer analyzer = new CJKAnalyzer();
    for (int i = 0; i < texts.size(); i++) {
      if (i > 0) out.print('\u0000');
      out.print(String.join("\u0001", tokens(analyzer, texts.get(i))));
    }
  }

  static void bm25(List<String> records, PrintStream out) throws Exception {
    Analyzer analyzer = new CJKAnalyzer();
    int n = Integer.parseInt(records.get(0));
    ByteBuffersDirectory dir = new ByteBuffersDirectory();
    try (IndexWriter w = new IndexWriter(dir, new IndexWriterConfig(analyzer))) {
      for (int i = 0; i < n; i++) {
        Document d = new Document();
        d.add(new TextField("f", records.get(1 + i), Store.NO));
        w.addDocument(d);
      }
      w.forceMerge(1);
    }
    IndexSearcher searcher = new IndexSearcher(DirectoryReader.open(dir));
    QueryBuilder qb = new QueryBuilder(analyzer);
    for (int q = 1 + n; q < records.size(); q++) {
      if (q > 1 + n) out.print('\u0000');
      Query query = qb.createBooleanQuery("f", records.get(q));
      if (query == null) continue;
      List<String> hits = new ArrayList<>();
      for (ScoreDoc sd : searcher.search(query, n).scoreDocs) {
        hits.add(sd.doc + ":" + Integer.toHexString(Float.floatToIntBits(sd.score)));
      }
      out.print(String.join("\u0001", hits));
    }
  }
}
